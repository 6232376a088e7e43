//! virtio-vsock (device id 19) with a Unix-socket host side, in the style of
//! Firecracker's: a host client connects to the device's socket and writes
//! `CONNECT <port>\n`; the device opens a connection to that guest port and
//! answers `OK <host port>\n` once the guest accepted it. A guest connecting
//! to host port `P` reaches the Unix socket `<path>_<P>`.
//!
//! All host-side descriptors (the listener, every connection's stream and a
//! timer for handshake deadlines) sit in the device's own epoll instance,
//! which is the one descriptor the VM's device thread polls. A stream is in
//! that set only while the device can act on it: a stream with data waiting
//! for a receive buffer or for guest credit is taken out, so the set is not
//! readable while the guest posts no receive buffers. Packets for the guest
//! are produced when a receive buffer is there to take them: per connection
//! as flags (request, response, shutdown, credit update, data), and in a
//! bounded queue for resets and final shutdowns of connections already gone.
//!
//! Connections are not part of snapshots: after a restore or rollback every
//! host connection is dropped and the guest is sent a transport-reset event.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT, Writer};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use super::VirtioDevice;
use crate::error::{Error, Result};
use crate::memory::GuestMem;

const DEVICE_VSOCK: u32 = 19;
const QUEUE_SIZES: [u16; 3] = [256; 3];
const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;

/// The host's context id, as the guest addresses it.
const HOST_CID: u64 = 2;
/// Size of `struct virtio_vsock_hdr`.
const HDR_LEN: usize = 44;
const TYPE_STREAM: u16 = 1;
const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;
/// Shutdown flag: the sender will receive no more.
const SHUTDOWN_RCV: u32 = 1;
/// Shutdown flag: the sender will send no more.
const SHUTDOWN_SEND: u32 = 2;
const EVENT_TRANSPORT_RESET: u32 = 0;

/// Largest payload of one packet, either way (Linux's limit too).
const MAX_PKT_LEN: usize = 64 * 1024;
/// Receive buffer each connection advertises to the guest: guest data the
/// host stream has not taken yet is held up to this much.
const BUF_ALLOC: u32 = 256 * 1024;
/// Most connections at once, handshakes included.
const MAX_CONNS: usize = 1024;
/// Most packets queued for connections already gone (resets, shutdowns).
const MAX_CTRL: usize = 4096;
/// Longest `CONNECT <port>\n` line, newline included.
const MAX_HANDSHAKE: usize = 32;
/// First local port of host-initiated connections.
const FIRST_HOST_PORT: u32 = 1 << 30;
/// Time a host client has to send its handshake, and the guest to answer a
/// connection request; also how long a closing connection may linger.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long the listener rests after `accept` failed (out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

const TOKEN_LISTENER: u64 = 0;
const TOKEN_TIMER: u64 = 1;
const FIRST_CONN_TOKEN: u64 = 2;

const EV_IN: u32 = EventSet::IN.bits();
const EV_OUT: u32 = EventSet::OUT.bits();
const EV_HUP: u32 = EventSet::HANG_UP.bits();
const EV_ERR: u32 = EventSet::ERROR.bits();

/// `struct virtio_vsock_hdr`, little-endian on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Hdr {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    kind: u16,
    op: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
}

fn le<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[at..at + N]);
    out
}

impl Hdr {
    fn to_bytes(self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.kind.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8; HDR_LEN]) -> Hdr {
        Hdr {
            src_cid: u64::from_le_bytes(le(b, 0)),
            dst_cid: u64::from_le_bytes(le(b, 8)),
            src_port: u32::from_le_bytes(le(b, 16)),
            dst_port: u32::from_le_bytes(le(b, 20)),
            len: u32::from_le_bytes(le(b, 24)),
            kind: u16::from_le_bytes(le(b, 28)),
            op: u16::from_le_bytes(le(b, 30)),
            flags: u32::from_le_bytes(le(b, 32)),
            buf_alloc: u32::from_le_bytes(le(b, 36)),
            fwd_cnt: u32::from_le_bytes(le(b, 40)),
        }
    }

    /// The reset answering a packet the device cannot take.
    fn reset_reply(&self) -> Hdr {
        Hdr {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            kind: TYPE_STREAM,
            op: OP_RST,
            ..Hdr::default()
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// A host client is writing its `CONNECT` line.
    Handshake,
    /// The guest was asked to accept the connection.
    AwaitResponse,
    Established,
}

/// What a connection has for the guest when a receive buffer is there.
enum Step {
    Packet(Hdr, Vec<u8>),
    Nothing,
    /// The host stream reached end of file.
    Eof,
    Fail(io::Error),
}

struct Conn {
    stream: UnixStream,
    state: State,
    /// Host-side port.
    local: u32,
    /// Guest-side port.
    peer: u32,
    host_initiated: bool,
    /// The handshake line read so far.
    line: Vec<u8>,
    deadline: Option<Instant>,
    /// Events the stream is registered for in the device's epoll (0: not in it).
    registered: u32,
    /// Whether the connection sits in the device's receive queue.
    queued: bool,
    want_request: bool,
    want_response: bool,
    want_shutdown: u32,
    want_credit_update: bool,
    /// The host stream may have data for the guest.
    data_ready: bool,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    tx_cnt: u32,
    /// Bytes received from the guest.
    rx_cnt: u32,
    /// Bytes of guest data written to the host stream.
    fwd_cnt: u32,
    /// `fwd_cnt` as last told to the guest.
    last_fwd_cnt_sent: u32,
    /// Guest data the host stream could not take yet.
    tx_buf: Vec<u8>,
    /// The host stream reached end of file.
    host_eof: bool,
    /// The guest will receive no more.
    guest_shut_rcv: bool,
    /// The guest will send no more.
    guest_shut_send: bool,
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

/// Sends without blocking and without raising SIGPIPE.
fn send(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of its length.
    let n = unsafe {
        libc::send(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(last_error());
    }
    Ok(n as usize)
}

/// Sends as much of `buf` as the stream takes now.
fn send_some(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match send(fd, &buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn recv(fd: RawFd, buf: &mut [u8], flags: i32) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            flags | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(last_error());
    }
    Ok(n as usize)
}

/// Whether the stream can neither be read nor written any more (the peer
/// closed it, or both directions were shut down).
fn hung_up(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLHUP != 0
}

/// Connects to a Unix stream socket without blocking: a listener whose
/// backlog is full refuses the connection instead of stalling the caller.
fn connect(path: &Path) -> io::Result<UnixStream> {
    // SAFETY: sockaddr_un is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket creation; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(last_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid sockaddr_un of the size given.
    let r = unsafe {
        libc::connect(
            fd,
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(last_error());
    }
    Ok(stream)
}

/// Reads the guest packet in `chain`: its header and payload.
fn read_packet(
    chain: DescriptorChain<&GuestMem>,
    mem: &GuestMem,
) -> std::result::Result<(Hdr, Vec<u8>), String> {
    let mut r = chain
        .reader(mem)
        .map_err(|e| format!("bad descriptor chain: {e}"))?;
    let avail = r.available_bytes();
    if avail < HDR_LEN {
        return Err(format!("{avail} bytes, shorter than a header"));
    }
    let mut b = [0u8; HDR_LEN];
    r.read_exact(&mut b)
        .map_err(|e| format!("reading the header: {e}"))?;
    let hdr = Hdr::from_bytes(&b);
    let len = hdr.len as usize;
    if len > MAX_PKT_LEN || len > r.available_bytes() {
        return Err(format!(
            "payload length {len} exceeds the buffer ({} bytes) or {MAX_PKT_LEN}",
            r.available_bytes()
        ));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)
        .map_err(|e| format!("reading the payload: {e}"))?;
    Ok((hdr, payload))
}

/// Parses a complete handshake line.
fn parse_connect(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line.strip_suffix(b"\n")?).ok()?;
    text.strip_prefix("CONNECT ")?.trim().parse().ok()
}

impl Conn {
    fn new(stream: UnixStream, state: State) -> Conn {
        Conn {
            stream,
            state,
            local: 0,
            peer: 0,
            host_initiated: false,
            line: Vec::new(),
            deadline: None,
            registered: 0,
            queued: false,
            want_request: false,
            want_response: false,
            want_shutdown: 0,
            want_credit_update: false,
            data_ready: false,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            tx_cnt: 0,
            rx_cnt: 0,
            fwd_cnt: 0,
            last_fwd_cnt_sent: 0,
            tx_buf: Vec::new(),
            host_eof: false,
            guest_shut_rcv: false,
            guest_shut_send: false,
        }
    }

    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// A header for a packet to the guest, carrying this side's credit.
    fn packet(&mut self, cid: u64, op: u16) -> Hdr {
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.want_credit_update = false;
        Hdr {
            src_cid: HOST_CID,
            dst_cid: cid,
            src_port: self.local,
            dst_port: self.peer,
            kind: TYPE_STREAM,
            op,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: self.fwd_cnt,
            ..Hdr::default()
        }
    }

    /// Bytes the guest can take now.
    fn peer_free(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn can_read(&self) -> bool {
        self.state == State::Established && !self.host_eof && !self.guest_shut_rcv
    }

    fn wants(&self) -> bool {
        self.want_request
            || self.want_response
            || self.want_shutdown != 0
            || self.want_credit_update
            || self.data_ready
    }

    /// The events the device waits for on this stream now.
    fn interest(&self) -> u32 {
        match self.state {
            State::Handshake => EV_IN,
            State::AwaitResponse => 0,
            State::Established => {
                let mut ev = 0;
                if self.can_read() && !self.data_ready && self.peer_free() > 0 {
                    ev |= EV_IN;
                }
                if !self.tx_buf.is_empty() {
                    ev |= EV_OUT;
                }
                if ev == 0 && (self.host_eof || self.guest_shut_rcv) {
                    // Nothing more to read: only notice the host closing.
                    ev = EV_HUP;
                }
                ev
            }
        }
    }

    /// Asks for a credit update once the guest's view of our free buffer
    /// has shrunk to half and some of it was freed since.
    fn check_credit(&mut self) {
        let unacked = self.rx_cnt.wrapping_sub(self.last_fwd_cnt_sent);
        if self.fwd_cnt != self.last_fwd_cnt_sent && unacked >= BUF_ALLOC / 2 {
            self.want_credit_update = true;
        }
    }

    /// Takes guest data for the host stream; an error means the connection
    /// is beyond repair (host gone, or the guest overran its credit).
    fn forward(&mut self, data: &[u8]) -> io::Result<()> {
        self.rx_cnt = self.rx_cnt.wrapping_add(data.len() as u32);
        let written = if self.tx_buf.is_empty() {
            send_some(self.fd(), data)?
        } else {
            0
        };
        let rest = &data[written..];
        if self.tx_buf.len() + rest.len() > BUF_ALLOC as usize {
            return Err(io::Error::other("guest overran its credit"));
        }
        self.tx_buf.extend_from_slice(rest);
        self.fwd_cnt = self.fwd_cnt.wrapping_add(written as u32);
        self.check_credit();
        Ok(())
    }

    /// Writes held guest data to the host stream.
    fn flush(&mut self) -> io::Result<()> {
        let n = send_some(self.fd(), &self.tx_buf)?;
        self.tx_buf.drain(..n);
        self.fwd_cnt = self.fwd_cnt.wrapping_add(n as u32);
        self.check_credit();
        if self.tx_buf.is_empty() && self.guest_shut_send {
            // The host may have closed its end already.
            let _ = self.stream.shutdown(Shutdown::Write);
        }
        Ok(())
    }

    /// The next packet for the guest, `room` being the payload space of the
    /// receive buffer at hand.
    fn take_packet(&mut self, cid: u64, room: usize) -> Step {
        if self.want_request {
            self.want_request = false;
            return Step::Packet(self.packet(cid, OP_REQUEST), Vec::new());
        }
        if self.want_response {
            self.want_response = false;
            return Step::Packet(self.packet(cid, OP_RESPONSE), Vec::new());
        }
        if self.want_shutdown != 0 {
            let mut h = self.packet(cid, OP_SHUTDOWN);
            h.flags = std::mem::take(&mut self.want_shutdown);
            return Step::Packet(h, Vec::new());
        }
        if self.data_ready {
            let free = self.peer_free() as usize;
            if !self.can_read() || free == 0 {
                self.data_ready = false;
            } else if room > 0 {
                let mut buf = vec![0u8; room.min(free).min(MAX_PKT_LEN)];
                loop {
                    match (&self.stream).read(&mut buf) {
                        Ok(0) => return Step::Eof,
                        Ok(n) => {
                            buf.truncate(n);
                            self.tx_cnt = self.tx_cnt.wrapping_add(n as u32);
                            let mut h = self.packet(cid, OP_RW);
                            h.len = n as u32;
                            return Step::Packet(h, buf);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            self.data_ready = false;
                            break;
                        }
                        Err(e) => return Step::Fail(e),
                    }
                }
            } else {
                // A buffer with room for a header only: no data fits, but a
                // credit update does, so the buffer does not block the queue.
                return Step::Packet(self.packet(cid, OP_CREDIT_UPDATE), Vec::new());
            }
        }
        if self.want_credit_update {
            return Step::Packet(self.packet(cid, OP_CREDIT_UPDATE), Vec::new());
        }
        Step::Nothing
    }

    /// Reads what the host client sent of its handshake, never past the
    /// line's end (bytes after it belong to the connection).
    fn read_line(&mut self) -> std::result::Result<Option<u32>, String> {
        let mut buf = [0u8; MAX_HANDSHAKE + 1];
        let want = MAX_HANDSHAKE + 1 - self.line.len();
        let n = match recv(self.fd(), &mut buf[..want], libc::MSG_PEEK) {
            Ok(0) => return Err("closed during the handshake".into()),
            Ok(n) => n,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                return Ok(None)
            }
            Err(e) => return Err(format!("reading the handshake: {e}")),
        };
        let take = buf[..n]
            .iter()
            .position(|b| *b == b'\n')
            .map_or(n, |i| i + 1);
        match recv(self.fd(), &mut buf[..take], 0) {
            Ok(got) if got == take => {}
            Ok(got) => return Err(format!("read {got} of {take} peeked bytes")),
            Err(e) => return Err(format!("reading the handshake: {e}")),
        }
        self.line.extend_from_slice(&buf[..take]);
        if self.line.len() > MAX_HANDSHAKE {
            return Err(format!("handshake longer than {MAX_HANDSHAKE} bytes"));
        }
        if self.line.last() != Some(&b'\n') {
            return Ok(None);
        }
        parse_connect(&self.line)
            .map(Some)
            .ok_or_else(|| format!("bad handshake {:?}", String::from_utf8_lossy(&self.line)))
    }
}

/// The vsock device.
pub struct Vsock {
    cid: u64,
    path: PathBuf,
    /// Device and inode of the socket file, to remove only our own on drop.
    socket_id: (u64, u64),
    listener: UnixListener,
    epoll: Epoll,
    timer: TimerFd,
    timeout: Duration,
    listener_paused_until: Option<Instant>,
    conns: HashMap<u64, Conn>,
    /// (host port, guest port) to connection token.
    by_key: HashMap<(u32, u32), u64>,
    host_ports: HashSet<u32>,
    next_token: u64,
    next_port: u32,
    /// Connections with packets for the guest, in turn.
    rxq: VecDeque<u64>,
    /// Packets for connections already gone.
    ctrl: VecDeque<Hdr>,
    event_pending: bool,
}

/// The host side of the handshake, for callers of a VM's vsock socket:
/// connects to `uds`, asks for guest port `port` and returns the stream once
/// the guest accepted the connection. Refused (nothing listens on the port
/// yet), a bad answer and no answer within `timeout` are errors.
pub fn host_connect(uds: &Path, port: u32, timeout: Duration) -> Result<UnixStream> {
    let what = || format!("vsock port {port} through {}", uds.display());
    let io = |e: io::Error| Error::io(what(), e);
    let mut stream = UnixStream::connect(uds).map_err(io)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(io)?;
    let deadline = Instant::now() + timeout;
    let mut line = Vec::with_capacity(MAX_HANDSHAKE);
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') {
        if line.len() >= MAX_HANDSHAKE || Instant::now() >= deadline {
            return Err(Error::Config(format!("{}: no answer to CONNECT", what())));
        }
        match stream.read(&mut byte).map_err(io)? {
            0 => {
                return Err(io(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    "the guest refused the connection",
                )))
            }
            _ => line.push(byte[0]),
        }
    }
    if !line.starts_with(b"OK ") {
        return Err(Error::Config(format!(
            "{}: unexpected answer {:?}",
            what(),
            String::from_utf8_lossy(&line)
        )));
    }
    stream.set_read_timeout(None).map_err(io)?;
    Ok(stream)
}

impl Vsock {
    /// A vsock device for a guest with context id `guest_cid`, listening for
    /// host clients on the Unix socket `uds_path` (a stale socket there is
    /// replaced; any other file is an error).
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Vsock> {
        Vsock::open(guest_cid, uds_path, TIMEOUT)
    }

    fn open(guest_cid: u64, uds_path: &Path, timeout: Duration) -> Result<Vsock> {
        if !(3..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(Error::Config(format!(
                "vsock guest CID {guest_cid} is invalid: it must be between 3 and {}",
                u32::MAX - 1
            )));
        }
        let shown = uds_path.display();
        match std::fs::symlink_metadata(uds_path) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(uds_path)
                .map_err(|e| Error::io(format!("removing stale vsock socket {shown}"), e))?,
            Ok(_) => {
                return Err(Error::Config(format!(
                    "vsock socket path {shown} exists and is not a socket"
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("checking vsock socket path {shown}"), e)),
        }
        let listener = UnixListener::bind(uds_path)
            .map_err(|e| Error::io(format!("binding vsock socket {shown}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io(format!("making vsock socket {shown} non-blocking"), e))?;
        let meta = std::fs::symlink_metadata(uds_path)
            .map_err(|e| Error::io(format!("checking vsock socket {shown}"), e))?;
        let epoll = Epoll::new().map_err(|e| Error::io("creating the vsock epoll", e))?;
        let timer = TimerFd::new().map_err(|e| Error::io("creating the vsock timer", e.into()))?;
        epoll
            .ctl(
                ControlOperation::Add,
                listener.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
            )
            .map_err(|e| Error::io("adding the vsock listener to its epoll", e))?;
        epoll
            .ctl(
                ControlOperation::Add,
                timer.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_TIMER),
            )
            .map_err(|e| Error::io("adding the vsock timer to its epoll", e))?;
        Ok(Vsock {
            cid: guest_cid,
            path: uds_path.to_path_buf(),
            socket_id: (meta.dev(), meta.ino()),
            listener,
            epoll,
            timer,
            timeout,
            listener_paused_until: None,
            conns: HashMap::new(),
            by_key: HashMap::new(),
            host_ports: HashSet::new(),
            next_token: FIRST_CONN_TOKEN,
            next_port: FIRST_HOST_PORT,
            rxq: VecDeque::new(),
            ctrl: VecDeque::new(),
            event_pending: false,
        })
    }

    fn insert(&mut self, conn: Conn) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        self.conns.insert(token, conn);
        token
    }

    fn enqueue(&mut self, token: u64) {
        if let Some(c) = self.conns.get_mut(&token) {
            if c.wants() && !c.queued {
                c.queued = true;
                self.rxq.push_back(token);
            }
        }
    }

    fn push_ctrl(&mut self, hdr: Hdr) {
        if self.ctrl.len() >= MAX_CTRL {
            tracing::warn!(
                "vsock: control queue full, dropping op {} to guest port {}",
                hdr.op,
                hdr.dst_port
            );
            return;
        }
        self.ctrl.push_back(hdr);
    }

    /// Forgets a connection and closes its stream.
    fn remove(&mut self, token: u64) -> Option<Conn> {
        let conn = self.conns.remove(&token)?;
        if conn.registered != 0 {
            if let Err(e) =
                self.epoll
                    .ctl(ControlOperation::Delete, conn.fd(), EpollEvent::default())
            {
                tracing::debug!("vsock: removing a stream from epoll: {e}");
            }
        }
        if conn.state != State::Handshake {
            self.by_key.remove(&(conn.local, conn.peer));
        }
        if conn.host_initiated {
            self.host_ports.remove(&conn.local);
        }
        Some(conn)
    }

    /// Drops a connection and resets it on the guest's side.
    fn reset_conn(&mut self, token: u64) {
        if let Some(mut conn) = self.remove(token) {
            if conn.state != State::Handshake {
                let h = conn.packet(self.cid, OP_RST);
                self.push_ctrl(h);
            }
        }
    }

    /// The host closed the stream for good: the guest is told neither side
    /// will send any more, and the connection is forgotten (the guest's own
    /// reset, when it comes, finds nothing to reset).
    fn host_gone(&mut self, token: u64) {
        if let Some(mut conn) = self.remove(token) {
            let mut h = conn.packet(self.cid, OP_SHUTDOWN);
            h.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
            self.push_ctrl(h);
        }
    }

    fn host_eof(&mut self, token: u64) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        conn.host_eof = true;
        conn.data_ready = false;
        if hung_up(conn.fd()) {
            self.host_gone(token);
        } else {
            conn.want_shutdown |= SHUTDOWN_SEND;
            self.enqueue(token);
            self.settle(token);
        }
    }

    /// Ends a connection both of whose directions are done.
    fn settle(&mut self, token: u64) {
        let Some(c) = self.conns.get(&token) else {
            return;
        };
        if c.state == State::Established
            && (c.host_eof || c.guest_shut_rcv)
            && c.guest_shut_send
            && c.tx_buf.is_empty()
        {
            self.reset_conn(token);
        }
    }

    fn alloc_port(&mut self, peer: u32) -> u32 {
        loop {
            let p = self.next_port;
            self.next_port = if p == u32::MAX - 1 {
                FIRST_HOST_PORT
            } else {
                p + 1
            };
            if !self.host_ports.contains(&p) && !self.by_key.contains_key(&(p, peer)) {
                return p;
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.conns.len() >= MAX_CONNS {
                        tracing::warn!("vsock: {MAX_CONNS} connections open, refusing another");
                        continue;
                    }
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!("vsock: making a host connection non-blocking: {e}");
                        continue;
                    }
                    let mut conn = Conn::new(stream, State::Handshake);
                    conn.deadline = Some(Instant::now() + self.timeout);
                    self.insert(conn);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("vsock: accepting a host connection: {e}");
                    self.pause_listener();
                    break;
                }
            }
        }
    }

    /// Takes the listener out of the epoll for a while, so a persistent
    /// `accept` failure does not make the device thread spin.
    fn pause_listener(&mut self) {
        match self.epoll.ctl(
            ControlOperation::Delete,
            self.listener.as_raw_fd(),
            EpollEvent::default(),
        ) {
            Ok(()) => self.listener_paused_until = Some(Instant::now() + ACCEPT_BACKOFF),
            Err(e) => tracing::warn!("vsock: pausing the listener: {e}"),
        }
    }

    fn resume_listener(&mut self) {
        let ev = EpollEvent::new(EventSet::IN, TOKEN_LISTENER);
        match self
            .epoll
            .ctl(ControlOperation::Add, self.listener.as_raw_fd(), ev)
        {
            Ok(()) => self.listener_paused_until = None,
            Err(e) => {
                tracing::warn!("vsock: resuming the listener: {e}");
                self.listener_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
            }
        }
    }

    fn handshake(&mut self, token: u64) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        match conn.read_line() {
            Ok(None) => {}
            Err(why) => {
                tracing::debug!("vsock: closing host connection: {why}");
                self.remove(token);
            }
            Ok(Some(port)) => {
                let local = self.alloc_port(port);
                let timeout = self.timeout;
                let Some(conn) = self.conns.get_mut(&token) else {
                    return;
                };
                conn.local = local;
                conn.peer = port;
                conn.host_initiated = true;
                conn.state = State::AwaitResponse;
                conn.deadline = Some(Instant::now() + timeout);
                conn.want_request = true;
                // The guest has not given its credit yet.
                conn.peer_buf_alloc = 0;
                self.by_key.insert((local, port), token);
                self.host_ports.insert(local);
                self.enqueue(token);
            }
        }
    }

    fn conn_event(&mut self, token: u64, events: u32) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        match conn.state {
            State::Handshake => self.handshake(token),
            State::AwaitResponse => {}
            State::Established => {
                let reg = conn.registered;
                let hup = events & (EV_HUP | EV_ERR) != 0;
                if reg & EV_OUT != 0 && (events & EV_OUT != 0 || hup) {
                    if let Err(e) = conn.flush() {
                        tracing::debug!("vsock: writing to host stream: {e}");
                        self.reset_conn(token);
                        return;
                    }
                    self.enqueue(token);
                    self.settle(token);
                }
                let Some(conn) = self.conns.get_mut(&token) else {
                    return;
                };
                if reg & EV_IN != 0 && (events & EV_IN != 0 || hup) {
                    conn.data_ready = true;
                    self.enqueue(token);
                } else if reg & (EV_IN | EV_OUT) == 0 && hup {
                    self.host_gone(token);
                }
            }
        }
    }

    fn guest_connect(&mut self, h: &Hdr) {
        if self.conns.len() >= MAX_CONNS || h.dst_port == u32::MAX {
            self.push_ctrl(h.reset_reply());
            return;
        }
        let mut path = self.path.clone().into_os_string();
        path.push(format!("_{}", h.dst_port));
        let path = PathBuf::from(path);
        match connect(&path) {
            Ok(stream) => {
                let mut conn = Conn::new(stream, State::Established);
                conn.local = h.dst_port;
                conn.peer = h.src_port;
                conn.peer_buf_alloc = h.buf_alloc;
                conn.peer_fwd_cnt = h.fwd_cnt;
                conn.want_response = true;
                let token = self.insert(conn);
                self.by_key.insert((h.dst_port, h.src_port), token);
                self.enqueue(token);
            }
            Err(e) => {
                tracing::debug!("vsock: guest connection to {}: {e}", path.display());
                self.push_ctrl(h.reset_reply());
            }
        }
    }

    /// The guest accepted a host-initiated connection.
    fn established(&mut self, token: u64) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let line = format!("OK {}\n", conn.local);
        match send(conn.fd(), line.as_bytes()) {
            Ok(n) if n == line.len() => {
                conn.state = State::Established;
                conn.deadline = None;
                conn.want_request = false;
            }
            Ok(_) => {
                tracing::debug!("vsock: host stream took part of the handshake answer");
                self.reset_conn(token);
            }
            Err(e) => {
                tracing::debug!("vsock: answering the host handshake: {e}");
                self.reset_conn(token);
            }
        }
    }

    fn guest_shutdown(&mut self, token: u64, flags: u32) {
        let timeout = self.timeout;
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        if flags & SHUTDOWN_RCV != 0 {
            c.guest_shut_rcv = true;
            c.data_ready = false;
            let _ = c.stream.shutdown(Shutdown::Read);
        }
        if flags & SHUTDOWN_SEND != 0 {
            c.guest_shut_send = true;
            if c.tx_buf.is_empty() {
                let _ = c.stream.shutdown(Shutdown::Write);
            }
        }
        if c.guest_shut_send
            && (c.guest_shut_rcv || c.host_eof)
            && !c.tx_buf.is_empty()
            && c.deadline.is_none()
        {
            // Give the host a while to take the rest.
            c.deadline = Some(Instant::now() + timeout);
        }
    }

    fn guest_packet(&mut self, h: Hdr, payload: &[u8]) {
        if h.kind != TYPE_STREAM {
            tracing::debug!("vsock: dropping packet of type {}", h.kind);
            return;
        }
        if h.src_cid != self.cid {
            tracing::debug!("vsock: dropping packet from CID {}", h.src_cid);
            return;
        }
        if h.dst_cid != HOST_CID {
            if h.op != OP_RST {
                self.push_ctrl(h.reset_reply());
            }
            return;
        }
        let Some(&token) = self.by_key.get(&(h.dst_port, h.src_port)) else {
            match h.op {
                OP_REQUEST => self.guest_connect(&h),
                OP_RST => {}
                _ => self.push_ctrl(h.reset_reply()),
            }
            return;
        };
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        conn.peer_buf_alloc = h.buf_alloc;
        conn.peer_fwd_cnt = h.fwd_cnt;
        match (conn.state, h.op) {
            (_, OP_RST) => {
                self.remove(token);
            }
            (State::AwaitResponse, OP_RESPONSE) => self.established(token),
            (State::Established, OP_RW) => {
                if conn.guest_shut_send {
                    tracing::debug!("vsock: dropping data sent after the guest's shutdown");
                } else if let Err(e) = conn.forward(payload) {
                    tracing::debug!("vsock: guest data to host stream: {e}");
                    self.reset_conn(token);
                }
            }
            (State::Established, OP_CREDIT_UPDATE) => {}
            (State::Established, OP_CREDIT_REQUEST) => conn.want_credit_update = true,
            (State::Established, OP_SHUTDOWN) => self.guest_shutdown(token, h.flags),
            (state, op) => {
                tracing::debug!("vsock: unexpected op {op} on a connection in state {state:?}");
                self.reset_conn(token);
            }
        }
        self.enqueue(token);
        self.settle(token);
    }

    fn process_tx(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(q) = queues.get_mut(TX) else {
            return false;
        };
        if !q.ready() || !q.is_valid(mem) {
            return false;
        }
        let mut used = false;
        while let Some(chain) = q.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            match read_packet(chain, mem) {
                Ok((h, payload)) => self.guest_packet(h, &payload),
                Err(why) => tracing::debug!("vsock: dropping malformed packet: {why}"),
            }
            if let Err(e) = q.add_used(mem, head, 0) {
                tracing::warn!("vsock: tx queue: {e}");
                break;
            }
            used = true;
        }
        used
    }

    /// Writes the next packet for the guest into `w`; returns the length
    /// written, or `None` when there is nothing to send.
    fn fill<B: vm_memory::bitmap::BitmapSlice>(&mut self, w: &mut Writer<'_, B>) -> Option<u32> {
        let room = w.available_bytes();
        if room < HDR_LEN {
            tracing::debug!("vsock: receive buffer of {room} bytes is too small");
            return Some(0);
        }
        let packet = loop {
            if let Some(h) = self.ctrl.pop_front() {
                break Some((h, Vec::new()));
            }
            let Some(token) = self.rxq.pop_front() else {
                break None;
            };
            let Some(conn) = self.conns.get_mut(&token) else {
                continue;
            };
            conn.queued = false;
            match conn.take_packet(self.cid, room - HDR_LEN) {
                Step::Packet(h, payload) => {
                    self.enqueue(token);
                    break Some((h, payload));
                }
                Step::Nothing => {}
                Step::Eof => self.host_eof(token),
                Step::Fail(e) => {
                    tracing::debug!("vsock: reading host stream: {e}");
                    self.reset_conn(token);
                }
            }
        };
        let (h, payload) = packet?;
        if let Err(e) = w
            .write_all(&h.to_bytes())
            .and_then(|()| w.write_all(&payload))
        {
            tracing::warn!("vsock: writing a packet to the guest: {e}");
        }
        Some(w.bytes_written() as u32)
    }

    fn deliver_rx(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(q) = queues.get_mut(RX) else {
            return false;
        };
        if !q.ready() || !q.is_valid(mem) {
            return false;
        }
        let mut used = false;
        while !self.ctrl.is_empty() || !self.rxq.is_empty() {
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let len = match chain.writer(mem) {
                Ok(mut w) => self.fill(&mut w),
                Err(e) => {
                    tracing::debug!("vsock: bad receive buffer: {e}");
                    Some(0)
                }
            };
            let Some(len) = len else {
                q.go_to_previous_position();
                break;
            };
            if let Err(e) = q.add_used(mem, head, len) {
                tracing::warn!("vsock: rx queue: {e}");
                break;
            }
            used = true;
        }
        used
    }

    fn deliver_event(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(q) = queues.get_mut(EVENT) else {
            return false;
        };
        if !self.event_pending || !q.ready() || !q.is_valid(mem) {
            return false;
        }
        let mut used = false;
        while self.event_pending {
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let len = match chain.writer(mem) {
                Ok(mut w) if w.available_bytes() >= 4 => {
                    match w.write_all(&EVENT_TRANSPORT_RESET.to_le_bytes()) {
                        Ok(()) => {
                            self.event_pending = false;
                            4
                        }
                        Err(e) => {
                            tracing::debug!("vsock: writing an event: {e}");
                            0
                        }
                    }
                }
                Ok(_) => 0,
                Err(e) => {
                    tracing::debug!("vsock: bad event buffer: {e}");
                    0
                }
            };
            if let Err(e) = q.add_used(mem, head, len) {
                tracing::warn!("vsock: event queue: {e}");
                break;
            }
            used = true;
        }
        used
    }

    fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(t, _)| *t)
            .collect();
        for token in expired {
            let Some(conn) = self.conns.get(&token) else {
                continue;
            };
            tracing::debug!(
                "vsock: connection to guest port {} timed out in state {:?}",
                conn.peer,
                conn.state
            );
            if conn.state == State::Handshake || conn.want_request {
                // The guest never heard of it.
                self.remove(token);
            } else {
                self.reset_conn(token);
            }
        }
        if self.listener_paused_until.is_some_and(|t| t <= now) {
            self.resume_listener();
        }
    }

    /// Brings every stream's epoll registration in line with what the
    /// device waits for.
    fn sync(&mut self) {
        let mut failed = Vec::new();
        for (&token, conn) in self.conns.iter_mut() {
            let want = conn.interest();
            if want == conn.registered {
                continue;
            }
            let op = if conn.registered == 0 {
                ControlOperation::Add
            } else if want == 0 {
                ControlOperation::Delete
            } else {
                ControlOperation::Modify
            };
            let ev = EpollEvent::new(EventSet::from_bits_truncate(want), token);
            match self.epoll.ctl(op, conn.fd(), ev) {
                Ok(()) => conn.registered = want,
                Err(e) => {
                    tracing::warn!("vsock: epoll registration of a stream: {e}");
                    failed.push(token);
                }
            }
        }
        for token in failed {
            self.reset_conn(token);
        }
    }

    fn rearm_timer(&mut self, now: Instant) {
        let next = self
            .conns
            .values()
            .filter_map(|c| c.deadline)
            .chain(self.listener_paused_until)
            .min();
        let r = match next {
            None => self.timer.clear(),
            Some(t) => self.timer.reset(
                t.saturating_duration_since(now)
                    .max(Duration::from_millis(1)),
                None,
            ),
        };
        if let Err(e) = r {
            tracing::warn!("vsock: arming the timer: {e}");
        }
    }

    /// Work common to every entry point: deadlines, packets for the guest,
    /// epoll registrations and the timer.
    fn pump(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        self.expire(Instant::now());
        let used = self.deliver_rx(queues, mem);
        self.sync();
        self.rearm_timer(Instant::now());
        used
    }

    fn drop_all(&mut self) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for token in tokens {
            self.remove(token);
        }
        self.rxq.clear();
        self.ctrl.clear();
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.socket_id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        DEVICE_VSOCK
    }

    fn describe(&self) -> String {
        let mut out = format!(
            "vsock: {} connections, {} queued for rx, {} control packets, event pending {}, next port {}",
            self.conns.len(),
            self.rxq.len(),
            self.ctrl.len(),
            self.event_pending,
            self.next_port
        );
        for c in self.conns.values() {
            out.push_str(&format!(
                "; {}->{} {:?} tx {} rx {} fwd {} peer credit {}/{}",
                c.local,
                c.peer,
                c.state,
                c.tx_cnt,
                c.rx_cnt,
                c.fwd_cnt,
                c.peer_fwd_cnt,
                c.peer_buf_alloc
            ));
        }
        out
    }

    fn features(&self) -> u64 {
        0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let cid = self.cid.to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| cid.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let used = match index {
            TX => self.process_tx(queues, mem),
            EVENT => self.deliver_event(queues, mem),
            _ => false,
        };
        self.pump(queues, mem) || used
    }

    fn host_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn process_host(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let mut events = [EpollEvent::default(); 64];
        let n = match self.epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("vsock: epoll_wait: {e}");
                0
            }
        };
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_LISTENER => self.accept_all(),
                // Deadlines are checked below on every call; re-arming
                // the timer makes it unreadable again.
                TOKEN_TIMER => {}
                token => self.conn_event(token, ev.events()),
            }
        }
        self.pump(queues, mem)
    }

    fn after_restore(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        self.drop_all();
        self.event_pending = true;
        let used = self.deliver_event(queues, mem);
        self.pump(queues, mem) || used
    }

    fn reset(&mut self) {
        self.drop_all();
        self.event_pending = false;
        self.rearm_timer(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::GuestRam;
    use vm_memory::{Bytes, GuestAddress};

    const CID: u64 = 42;
    const QSIZE: u16 = 256;
    /// Bytes behind each descriptor of the fake driver.
    const SLOT: u64 = 0x11000;
    /// Guest memory of each queue: rings, then one slot per descriptor.
    const QREGION: u64 = 0x120_0000;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;
    const WAIT: Duration = Duration::from_secs(5);

    /// The driver's side of one split virtqueue.
    struct Vq {
        base: u64,
        free: Vec<u16>,
        chains: HashMap<u16, Vec<(u16, u32)>>,
        avail_idx: u16,
        used_idx: u16,
    }

    impl Vq {
        fn new(n: u64) -> Vq {
            Vq {
                base: n * QREGION,
                free: (0..QSIZE).rev().collect(),
                chains: HashMap::new(),
                avail_idx: 0,
                used_idx: 0,
            }
        }

        fn avail(&self) -> u64 {
            self.base + 0x1000
        }

        fn used(&self) -> u64 {
            self.base + 0x2000
        }

        fn slot(&self, i: u16) -> u64 {
            self.base + 0x10000 + u64::from(i) * SLOT
        }

        fn queue(&self) -> Queue {
            let mut q = Queue::new(QSIZE).unwrap();
            q.set_size(QSIZE);
            q.try_set_desc_table_address(GuestAddress(self.base))
                .unwrap();
            q.try_set_avail_ring_address(GuestAddress(self.avail()))
                .unwrap();
            q.try_set_used_ring_address(GuestAddress(self.used()))
                .unwrap();
            q.set_ready(true);
            q
        }

        /// Makes a chain of (length, device-writable, contents) available.
        fn post(&mut self, mem: &GuestMem, descs: &[(u32, bool, &[u8])]) {
            self.post_at(mem, descs, None);
        }

        /// As `post`, with the first descriptor at `addr` if given.
        fn post_at(&mut self, mem: &GuestMem, descs: &[(u32, bool, &[u8])], addr: Option<u64>) {
            let idx: Vec<u16> = descs.iter().map(|_| self.free.pop().unwrap()).collect();
            for (k, (&i, &(len, writable, data))) in idx.iter().zip(descs).enumerate() {
                let at = match (k, addr) {
                    (0, Some(a)) => a,
                    _ => self.slot(i),
                };
                if !data.is_empty() {
                    mem.write_slice(data, GuestAddress(at)).unwrap();
                }
                let mut flags = if writable { F_WRITE } else { 0 };
                let next = idx.get(k + 1).copied().unwrap_or(0);
                if k + 1 < idx.len() {
                    flags |= F_NEXT;
                }
                let d = self.base + u64::from(i) * 16;
                mem.write_obj(at, GuestAddress(d)).unwrap();
                mem.write_obj(len, GuestAddress(d + 8)).unwrap();
                mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
                mem.write_obj(next, GuestAddress(d + 14)).unwrap();
            }
            let ring = self.avail() + 4 + 2 * u64::from(self.avail_idx % QSIZE);
            mem.write_obj(idx[0], GuestAddress(ring)).unwrap();
            self.avail_idx = self.avail_idx.wrapping_add(1);
            mem.write_obj(self.avail_idx, GuestAddress(self.avail() + 2))
                .unwrap();
            let chain = idx.iter().zip(descs).map(|(&i, d)| (i, d.0)).collect();
            self.chains.insert(idx[0], chain);
        }

        /// Chains the device used since the last call, with the bytes it
        /// wrote (gathered across the chain's descriptors).
        fn take_used(&mut self, mem: &GuestMem) -> Vec<(u32, Vec<u8>)> {
            let idx: u16 = mem.read_obj(GuestAddress(self.used() + 2)).unwrap();
            let mut out = Vec::new();
            while self.used_idx != idx {
                let e = self.used() + 4 + 8 * u64::from(self.used_idx % QSIZE);
                let head = mem.read_obj::<u32>(GuestAddress(e)).unwrap() as u16;
                let len = mem.read_obj::<u32>(GuestAddress(e + 4)).unwrap();
                self.used_idx = self.used_idx.wrapping_add(1);
                let chain = self.chains.remove(&head).unwrap();
                let mut data = Vec::new();
                let mut left = len as usize;
                for (i, dlen) in chain {
                    let n = left.min(dlen as usize);
                    let mut b = vec![0u8; n];
                    mem.read_slice(&mut b, GuestAddress(self.slot(i))).unwrap();
                    data.extend_from_slice(&b);
                    left -= n;
                    self.free.push(i);
                }
                out.push((len, data));
            }
            out
        }
    }

    /// A device, guest memory with the three queues and a fake driver.
    struct Rig {
        _ram: GuestRam,
        mem: GuestMem,
        queues: Vec<Queue>,
        vqs: Vec<Vq>,
        dev: Vsock,
        uds: PathBuf,
        inbox: VecDeque<(Hdr, Vec<u8>)>,
        /// Receive buffers the device returned empty.
        empty_rx: usize,
        _dir: tempfile::TempDir,
    }

    fn rig() -> Rig {
        rig_with_timeout(TIMEOUT)
    }

    fn rig_with_timeout(timeout: Duration) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let ram = GuestRam::reserve(3 * QREGION as usize).unwrap();
        let mem = ram.memory().clone();
        let vqs: Vec<Vq> = (0..3).map(Vq::new).collect();
        let queues = vqs.iter().map(Vq::queue).collect();
        let dev = Vsock::open(CID, &uds, timeout).unwrap();
        Rig {
            _ram: ram,
            mem,
            queues,
            vqs,
            dev,
            uds,
            inbox: VecDeque::new(),
            empty_rx: 0,
            _dir: dir,
        }
    }

    fn guest_hdr(src_port: u32, dst_port: u32, op: u16) -> Hdr {
        Hdr {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            kind: TYPE_STREAM,
            op,
            buf_alloc: BUF_ALLOC,
            ..Hdr::default()
        }
    }

    fn poll_in(fd: RawFd, ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, ms) > 0 }
    }

    impl Rig {
        fn process(&mut self, index: usize) -> bool {
            self.dev.process_queue(index, &mut self.queues, &self.mem)
        }

        /// Posts `n` receive buffers, each a 44-byte header descriptor and a
        /// 4 KiB data descriptor, like Linux 6.1.
        fn post_rx(&mut self, n: usize) {
            for _ in 0..n {
                self.vqs[RX].post(&self.mem, &[(44, true, &[]), (4096, true, &[])]);
            }
            self.process(RX);
            self.collect();
        }

        /// Sends one packet, header and payload in separate descriptors.
        fn send(&mut self, h: Hdr, payload: &[u8]) {
            let h = Hdr {
                len: payload.len() as u32,
                ..h
            };
            let bytes = h.to_bytes();
            if payload.is_empty() {
                self.send_raw(&[(44, false, &bytes)]);
            } else {
                self.send_raw(&[(44, false, &bytes), (payload.len() as u32, false, payload)]);
            }
        }

        fn send_raw(&mut self, descs: &[(u32, bool, &[u8])]) {
            self.vqs[TX].post(&self.mem, descs);
            assert!(self.process(TX), "tx buffer used");
            assert_eq!(self.vqs[TX].take_used(&self.mem).len(), 1);
            self.collect();
        }

        fn collect(&mut self) {
            for (len, data) in self.vqs[RX].take_used(&self.mem) {
                if len == 0 {
                    self.empty_rx += 1;
                    continue;
                }
                assert!(len as usize >= HDR_LEN, "rx packet of {len} bytes");
                let h = Hdr::from_bytes(&le(&data, 0));
                assert_eq!(h.len as usize, data.len() - HDR_LEN, "{h:?}");
                self.inbox.push_back((h, data[HDR_LEN..].to_vec()));
            }
        }

        /// Lets the device handle host events for up to `ms` milliseconds.
        fn pump(&mut self, ms: i32) {
            let fd = self.dev.host_fd().unwrap();
            if poll_in(fd, ms) {
                self.dev.process_host(&mut self.queues, &self.mem);
            }
            self.collect();
        }

        /// Waits for the first packet matching `pred`.
        fn expect(&mut self, what: &str, pred: impl Fn(&Hdr) -> bool) -> (Hdr, Vec<u8>) {
            let deadline = Instant::now() + WAIT;
            loop {
                if let Some(i) = self.inbox.iter().position(|(h, _)| pred(h)) {
                    return self.inbox.remove(i).unwrap();
                }
                assert!(Instant::now() < deadline, "no {what}; got {:?}", self.inbox);
                self.pump(10);
            }
        }

        /// A host client asking for guest port `port`; returns it and the
        /// request the guest saw.
        fn host_connect(&mut self, port: u32) -> (UnixStream, Hdr) {
            let mut s = UnixStream::connect(&self.uds).unwrap();
            s.set_nonblocking(true).unwrap();
            s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
            let (h, _) = self.expect("request", |h| h.op == OP_REQUEST);
            (s, h)
        }

        /// A host-initiated connection the guest accepted with `buf_alloc`.
        fn establish(&mut self, port: u32, buf_alloc: u32) -> (UnixStream, u32) {
            self.post_rx(16);
            let (mut s, req) = self.host_connect(port);
            assert_eq!(
                (req.src_cid, req.dst_cid, req.dst_port, req.kind),
                (HOST_CID, CID, port, TYPE_STREAM)
            );
            assert!(req.src_port >= FIRST_HOST_PORT);
            let resp = Hdr {
                buf_alloc,
                ..guest_hdr(port, req.src_port, OP_RESPONSE)
            };
            self.send(resp, &[]);
            let line = self.read_host(&mut s, format!("OK {}\n", req.src_port).len());
            assert_eq!(line, format!("OK {}\n", req.src_port).into_bytes());
            (s, req.src_port)
        }

        /// Reads `n` bytes from a host stream, pumping the device meanwhile.
        fn read_host(&mut self, s: &mut UnixStream, n: usize) -> Vec<u8> {
            let deadline = Instant::now() + WAIT;
            let mut out = vec![0u8; n];
            let mut got = 0;
            while got < n {
                match s.read(&mut out[got..]) {
                    Ok(0) => panic!("EOF after {got} of {n} bytes"),
                    Ok(k) => got += k,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        assert!(Instant::now() < deadline, "{got} of {n} bytes");
                        self.pump(10);
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            out
        }

        /// Waits until the host stream is closed by the device.
        fn expect_closed(&mut self, s: &mut UnixStream) {
            s.set_nonblocking(true).unwrap();
            let deadline = Instant::now() + WAIT;
            let mut buf = [0u8; 256];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => panic!("unexpected data {:?}", &buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        assert!(Instant::now() < deadline, "stream still open");
                        self.pump(10);
                    }
                    Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return,
                    Err(e) => panic!("{e}"),
                }
            }
        }

        /// Fills every posted receive buffer with host data, which the
        /// guest then drops.
        fn use_up_rx(&mut self, s: &mut UnixStream) {
            let posted = self.vqs[RX].avail_idx.wrapping_sub(self.vqs[RX].used_idx);
            s.write_all(&vec![1u8; posted as usize * 4096]).unwrap();
            let mut n = 0;
            while n < posted as usize * 4096 {
                let (_, data) = self.expect("data", |h| h.op == OP_RW);
                n += data.len();
            }
            assert_eq!(self.vqs[RX].avail_idx, self.vqs[RX].used_idx);
        }

        /// Receives `n` bytes of data on `(local, peer)`, acknowledging it
        /// with credit updates (`consumed` bytes were consumed before) so
        /// the device can send more.
        fn guest_read(
            &mut self,
            (local, peer): (u32, u32),
            n: usize,
            buf_alloc: u32,
            consumed: usize,
        ) -> Vec<u8> {
            let mut out = Vec::new();
            while out.len() < n {
                let (h, data) = self.expect("data", |h| h.op == OP_RW);
                assert_eq!((h.src_port, h.dst_port), (local, peer));
                assert!(data.len() <= 4096);
                out.extend_from_slice(&data);
                // Consume and acknowledge.
                let upd = Hdr {
                    buf_alloc,
                    fwd_cnt: (consumed + out.len()) as u32,
                    ..guest_hdr(peer, local, OP_CREDIT_UPDATE)
                };
                self.send(upd, &[]);
                self.post_rx(1);
            }
            out
        }
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn config_space_holds_the_guest_cid() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Vsock::new(0x1122_3344_5566_7788 & 0xffff_ffff, &dir.path().join("s")).unwrap();
        assert_eq!(dev.device_type(), 19);
        assert_eq!(dev.queue_max_sizes(), &[256, 256, 256]);
        assert_eq!(dev.features(), 0);
        let mut b = [0u8; 8];
        dev.read_config(0, &mut b);
        assert_eq!(u64::from_le_bytes(b), 0x5566_7788);
        let mut b = [0xffu8; 4];
        dev.read_config(2, &mut b);
        assert_eq!(b, [0x66, 0x55, 0, 0]);
        let mut b = [0xffu8; 2];
        dev.read_config(7, &mut b);
        assert_eq!(b, [0, 0]);
        dev.read_config(u64::MAX, &mut b);
        assert_eq!(b, [0, 0]);
        assert!(
            Vsock::new(2, &dir.path().join("t")).is_err(),
            "CID 2 is the host's"
        );
        // A stale socket is replaced, any other file is refused.
        drop(dev);
        let stale = dir.path().join("stale");
        drop(UnixListener::bind(&stale).unwrap());
        let dev = Vsock::new(3, &stale).unwrap();
        UnixStream::connect(&stale).unwrap();
        drop(dev);
        assert!(!stale.exists(), "socket removed on drop");
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(Vsock::new(3, &file), Err(Error::Config(_))));
    }

    #[test]
    fn host_connects_and_data_flows_both_ways_under_credit() {
        let mut r = rig();
        // The guest's receive window is smaller than what the host sends.
        let window = 10_000;
        let (mut s, local) = r.establish(1234, window);

        // Host to guest: no more than the window until the guest says it
        // consumed data.
        let sent = pattern(25_000, 7);
        s.write_all(&sent).unwrap();
        let mut got = Vec::new();
        let deadline = Instant::now() + WAIT;
        while got.len() < window as usize {
            assert!(Instant::now() < deadline, "got {}", got.len());
            r.pump(10);
            while let Some(i) = r.inbox.iter().position(|(h, _)| h.op == OP_RW) {
                let (h, data) = r.inbox.remove(i).unwrap();
                assert_eq!((h.src_port, h.dst_port, h.dst_cid), (local, 1234, CID));
                assert_eq!(h.buf_alloc, BUF_ALLOC);
                got.extend_from_slice(&data);
            }
        }
        assert_eq!(got.len(), window as usize, "no more than the credit");
        for _ in 0..5 {
            r.pump(10);
        }
        assert!(
            r.inbox.iter().all(|(h, _)| h.op != OP_RW),
            "data beyond the credit"
        );
        // The guest consumed it all; the rest follows.
        let rest = {
            let upd = Hdr {
                buf_alloc: window,
                fwd_cnt: got.len() as u32,
                ..guest_hdr(1234, local, OP_CREDIT_UPDATE)
            };
            r.send(upd, &[]);
            r.guest_read((local, 1234), sent.len() - got.len(), window, got.len())
        };
        got.extend_from_slice(&rest);
        assert_eq!(got, sent, "byte-exact host to guest");

        // Guest to host: a full window while the host reads nothing, so the
        // device holds what the socket cannot take; then the host reads and
        // credit updates let the guest send the rest.
        let data = pattern(700_000, 3);
        let mut tx = 0usize;
        let mut dev_fwd = 0u32;
        let mut received = Vec::new();
        let mut host_reading = false;
        let deadline = Instant::now() + WAIT * 2;
        while received.len() < data.len() {
            assert!(Instant::now() < deadline, "received {}", received.len());
            let credit = BUF_ALLOC as usize - (tx - dev_fwd as usize);
            let n = credit.min(MAX_PKT_LEN).min(data.len() - tx);
            if n > 0 {
                r.send(guest_hdr(1234, local, OP_RW), &data[tx..tx + n]);
                tx += n;
                continue;
            }
            if !host_reading {
                // The window is full: nothing was lost, the device buffers.
                host_reading = true;
                assert_eq!(tx, BUF_ALLOC as usize);
                let held: usize = r.dev.conns.values().map(|c| c.tx_buf.len()).sum();
                assert!(held > 0, "the host socket took a whole window");
            }
            let mut buf = vec![0u8; 65536];
            match s.read(&mut buf) {
                Ok(0) => panic!("EOF"),
                Ok(k) => received.extend_from_slice(&buf[..k]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => r.pump(10),
                Err(e) => panic!("{e}"),
            }
            r.pump(0);
            for (h, _) in r.inbox.drain(..) {
                assert_eq!(h.buf_alloc, BUF_ALLOC);
                assert!(
                    h.fwd_cnt.wrapping_sub(dev_fwd) < 1 << 31,
                    "fwd_cnt goes forward"
                );
                dev_fwd = h.fwd_cnt;
            }
        }
        assert_eq!(received, data, "byte-exact guest to host");
        let idle_fd = r.dev.host_fd().unwrap();
        assert!(!poll_in(idle_fd, 20), "device idle");
    }

    #[test]
    fn receive_buffers_may_split_the_header() {
        let mut r = rig();
        let (mut s, local) = r.establish(5, BUF_ALLOC);
        r.use_up_rx(&mut s);
        s.write_all(b"split header").unwrap();
        r.vqs[RX].post(
            &r.mem,
            &[(10, true, &[]), (20, true, &[]), (100, true, &[])],
        );
        r.process(RX);
        let (h, data) = r.expect("data", |h| h.op == OP_RW);
        assert_eq!(h.src_port, local);
        assert_eq!(data, b"split header");
        // A buffer with room for a header only cannot carry data: it gets a
        // credit update and the data goes into the next buffer.
        s.write_all(b"more").unwrap();
        r.vqs[RX].post(&r.mem, &[(44, true, &[])]);
        r.vqs[RX].post(&r.mem, &[(44, true, &[]), (100, true, &[])]);
        r.process(RX);
        let (h, _) = r.expect("credit update", |h| h.op == OP_CREDIT_UPDATE);
        assert_eq!(h.src_port, local);
        let (_, data) = r.expect("data", |h| h.op == OP_RW);
        assert_eq!(data, b"more");
    }

    #[test]
    fn guest_reset_refuses_a_host_connection() {
        let mut r = rig();
        r.post_rx(4);
        let (mut s, req) = r.host_connect(99);
        r.send(guest_hdr(99, req.src_port, OP_RST), &[]);
        r.expect_closed(&mut s);
        assert!(r.dev.conns.is_empty());
    }

    #[test]
    fn host_connect_returns_the_stream_once_the_guest_accepts() {
        let mut r = rig();
        r.post_rx(8);
        for (port, answer) in [(1024, OP_RESPONSE), (1025, OP_RST)] {
            let uds = r.uds.clone();
            let client =
                std::thread::spawn(move || host_connect(&uds, port, Duration::from_secs(10)));
            let (req, _) = r.expect("request", |h| h.op == OP_REQUEST);
            assert_eq!(req.dst_port, port);
            r.send(guest_hdr(port, req.src_port, answer), &[]);
            let deadline = Instant::now() + WAIT;
            while !client.is_finished() {
                assert!(Instant::now() < deadline, "host_connect did not return");
                r.pump(10);
            }
            let result = client.join().unwrap();
            if answer == OP_RESPONSE {
                assert!(result.is_ok(), "{result:?}");
            } else {
                let e = result.unwrap_err().to_string();
                assert!(e.contains("refused"), "{e}");
            }
        }
        let silent = host_connect(&r.uds, 7, Duration::from_millis(50)).unwrap_err();
        assert!(silent.to_string().contains("vsock port 7"), "{silent}");
    }

    #[test]
    fn bad_handshakes_close_the_stream() {
        let mut r = rig();
        r.post_rx(4);
        for line in [
            &b"HELLO 5\n"[..],
            b"CONNECT x\n",
            b"CONNECT 99999999999\n",
            &[b'C'; 40],
            b"CONNECT 1234567890123456789012345\n",
        ] {
            let mut s = UnixStream::connect(&r.uds).unwrap();
            s.write_all(line).unwrap();
            r.expect_closed(&mut s);
        }
        assert!(r.inbox.is_empty(), "the guest heard nothing: {:?}", r.inbox);
        assert!(r.dev.conns.is_empty());
    }

    #[test]
    fn silent_clients_and_silent_guests_time_out() {
        let mut r = rig_with_timeout(Duration::from_millis(100));
        r.post_rx(4);
        // A client that never finishes its line.
        let mut s = UnixStream::connect(&r.uds).unwrap();
        s.write_all(b"CONNECT 1").unwrap();
        r.expect_closed(&mut s);
        // A guest that never answers the request: the stream is closed and
        // the guest told to drop the half-open connection.
        let (mut s, req) = r.host_connect(77);
        r.expect_closed(&mut s);
        let (rst, _) = r.expect("reset", |h| h.op == OP_RST);
        assert_eq!((rst.src_port, rst.dst_port), (req.src_port, 77));
        assert!(r.dev.conns.is_empty());
        let fd = r.dev.host_fd().unwrap();
        assert!(!poll_in(fd, 300), "timer disarmed when nothing is pending");
    }

    #[test]
    fn guest_connects_to_host_sockets() {
        let mut r = rig();
        r.post_rx(8);
        let mut path = r.uds.clone().into_os_string();
        path.push("_5000");
        let listener = UnixListener::bind(PathBuf::from(path)).unwrap();
        r.send(guest_hdr(7777, 5000, OP_REQUEST), &[]);
        let (h, _) = r.expect("response", |h| h.op == OP_RESPONSE);
        assert_eq!((h.src_port, h.dst_port, h.src_cid), (5000, 7777, HOST_CID));
        let (mut s, _) = listener.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        r.send(guest_hdr(7777, 5000, OP_RW), b"hello host");
        assert_eq!(r.read_host(&mut s, 10), b"hello host");
        s.write_all(b"hello guest").unwrap();
        let (h, data) = r.expect("data", |h| h.op == OP_RW);
        assert_eq!((h.src_port, h.dst_port), (5000, 7777));
        assert_eq!(data, b"hello guest");
        // A credit request is answered.
        r.send(guest_hdr(7777, 5000, OP_CREDIT_REQUEST), &[]);
        let (h, _) = r.expect("credit update", |h| h.op == OP_CREDIT_UPDATE);
        assert_eq!((h.buf_alloc, h.fwd_cnt), (BUF_ALLOC, 10));
        // Nobody listens on port 5001.
        r.send(guest_hdr(7778, 5001, OP_REQUEST), &[]);
        let (h, _) = r.expect("reset", |h| h.op == OP_RST);
        assert_eq!((h.src_port, h.dst_port), (5001, 7778));
        // Packets for unknown connections are reset, resets are not.
        r.send(guest_hdr(7779, 5000, OP_RW), b"x");
        let (h, _) = r.expect("reset", |h| h.op == OP_RST);
        assert_eq!(h.dst_port, 7779);
        r.send(guest_hdr(7779, 5000, OP_RST), &[]);
        // The guest shuts down its sending side: the host reads EOF; then
        // its receiving side: the connection is over and reset.
        r.send(
            Hdr {
                flags: SHUTDOWN_SEND,
                ..guest_hdr(7777, 5000, OP_SHUTDOWN)
            },
            &[],
        );
        let mut buf = [0u8; 8];
        let deadline = Instant::now() + WAIT;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => panic!("data {:?}", &buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline);
                    r.pump(10);
                }
                Err(e) => panic!("{e}"),
            }
        }
        s.write_all(b"still open").unwrap();
        let (_, data) = r.expect("data", |h| h.op == OP_RW);
        assert_eq!(data, b"still open");
        r.send(
            Hdr {
                flags: SHUTDOWN_RCV | SHUTDOWN_SEND,
                ..guest_hdr(7777, 5000, OP_SHUTDOWN)
            },
            &[],
        );
        let (h, _) = r.expect("reset", |h| h.op == OP_RST);
        assert_eq!(h.dst_port, 7777);
        assert!(r.inbox.is_empty(), "{:?}", r.inbox);
        assert!(r.dev.conns.is_empty());
    }

    #[test]
    fn host_disconnects_are_told_to_the_guest() {
        let mut r = rig();
        // Full close, with data still in flight: data first, then shutdown.
        let (mut s, local) = r.establish(10, BUF_ALLOC);
        s.write_all(b"last words").unwrap();
        drop(s);
        let (h, data) = r.expect("data", |h| h.op == OP_RW);
        assert_eq!((h.src_port, data.as_slice()), (local, &b"last words"[..]));
        let (h, _) = r.expect("shutdown", |h| h.op == OP_SHUTDOWN);
        assert_eq!(h.src_port, local);
        assert_eq!(h.flags, SHUTDOWN_RCV | SHUTDOWN_SEND);
        assert!(r.dev.conns.is_empty());
        // The guest's late reset finds nothing and gets no answer.
        r.send(guest_hdr(10, local, OP_RST), &[]);
        assert!(r.inbox.is_empty());

        // Half close: the guest may still answer.
        let (s, local) = r.establish(11, BUF_ALLOC);
        s.shutdown(Shutdown::Write).unwrap();
        let (h, _) = r.expect("shutdown", |h| h.op == OP_SHUTDOWN);
        assert_eq!((h.src_port, h.flags), (local, SHUTDOWN_SEND));
        r.send(guest_hdr(11, local, OP_RW), b"answer");
        let mut s = s;
        assert_eq!(r.read_host(&mut s, 6), b"answer");
        // Then the host goes away entirely.
        drop(s);
        let (h, _) = r.expect("shutdown", |h| h.op == OP_SHUTDOWN);
        assert_eq!(h.flags, SHUTDOWN_RCV | SHUTDOWN_SEND);
        assert!(r.dev.conns.is_empty());
    }

    #[test]
    fn without_receive_buffers_the_host_fd_goes_quiet() {
        let mut r = rig();
        let (mut s, local) = r.establish(20, BUF_ALLOC);
        r.use_up_rx(&mut s);
        s.write_all(b"ping").unwrap();
        let fd = r.dev.host_fd().unwrap();
        r.pump(100);
        assert!(
            !poll_in(fd, 100),
            "host fd readable without receive buffers"
        );
        assert!(r.inbox.is_empty());
        // Posting buffers delivers the waiting data...
        r.post_rx(4);
        let (h, data) = r.expect("data", |h| h.op == OP_RW);
        assert_eq!((h.src_port, data.as_slice()), (local, &b"ping"[..]));
        // ...and the stream is watched again.
        s.write_all(b"pong").unwrap();
        assert!(poll_in(fd, 5000), "host fd re-armed");
        let (_, data) = r.expect("data", |h| h.op == OP_RW);
        assert_eq!(data, b"pong");
    }

    #[test]
    fn restore_drops_connections_and_resets_the_transport() {
        let mut r = rig();
        let (mut s, _) = r.establish(30, BUF_ALLOC);
        let mut pending = UnixStream::connect(&r.uds).unwrap();
        pending.write_all(b"CONN").unwrap();
        r.pump(10);
        assert_eq!(r.dev.conns.len(), 2);
        // No event buffer yet: the event waits for one.
        assert!(!r.dev.after_restore(&mut r.queues, &r.mem));
        r.expect_closed(&mut s);
        r.expect_closed(&mut pending);
        assert!(r.dev.conns.is_empty());
        r.vqs[EVENT].post(&r.mem, &[(4, true, &[])]);
        assert!(r.process(EVENT));
        let used = r.vqs[EVENT].take_used(&r.mem);
        assert_eq!(
            used,
            vec![(4, EVENT_TRANSPORT_RESET.to_le_bytes().to_vec())]
        );
        // Only one event.
        r.vqs[EVENT].post(&r.mem, &[(4, true, &[])]);
        r.process(EVENT);
        assert!(r.vqs[EVENT].take_used(&r.mem).is_empty());
        // With a buffer posted, after_restore uses it at once.
        assert!(r.dev.after_restore(&mut r.queues, &r.mem));
        assert_eq!(r.vqs[EVENT].take_used(&r.mem).len(), 1);
        // The listener still works.
        r.establish(31, BUF_ALLOC);
        r.dev.reset();
        assert!(r.dev.conns.is_empty());
    }

    #[test]
    fn malformed_packets_are_dropped() {
        let mut r = rig();
        // A receive buffer outside guest memory, first in line.
        r.vqs[RX].post_at(&r.mem, &[(4096, true, &[])], Some(1 << 40));
        r.process(RX);
        let good = guest_hdr(1, 6000, OP_REQUEST).to_bytes();
        // Short header.
        r.send_raw(&[(20, false, &good[..20])]);
        // Length beyond the descriptors.
        let long = Hdr {
            len: 100,
            ..guest_hdr(1, 6000, OP_RW)
        };
        r.send_raw(&[(44, false, &long.to_bytes()), (50, false, &[0u8; 50])]);
        // Length beyond the packet limit.
        let huge = Hdr {
            len: u32::MAX,
            ..guest_hdr(1, 6000, OP_RW)
        };
        r.send_raw(&[(44, false, &huge.to_bytes())]);
        // Not a stream.
        let dgram = Hdr {
            kind: 3,
            ..guest_hdr(1, 6000, OP_REQUEST)
        };
        r.send_raw(&[(44, false, &dgram.to_bytes())]);
        // Another guest's CID.
        let other = Hdr {
            src_cid: 7,
            ..guest_hdr(1, 6000, OP_REQUEST)
        };
        r.send_raw(&[(44, false, &other.to_bytes())]);
        // A descriptor outside guest memory.
        r.vqs[TX].post_at(&r.mem, &[(44, false, &[])], Some(1 << 40));
        assert!(r.process(TX));
        assert_eq!(r.vqs[TX].take_used(&r.mem).len(), 1);
        // Only device-writable descriptors.
        r.send_raw(&[(44, true, &[])]);
        for _ in 0..3 {
            r.pump(10);
        }
        assert_eq!(r.empty_rx, 0, "nothing for the guest yet");
        // The device still works: a request to a missing socket is reset,
        // and the bad receive buffer comes back empty.
        r.send(guest_hdr(1, 6000, OP_REQUEST), &[]);
        r.post_rx(4);
        let (h, _) = r.expect("reset", |h| h.op == OP_RST);
        assert_eq!(h.dst_port, 1);
        assert_eq!(r.empty_rx, 1, "the bad receive buffer came back empty");
        assert!(r.inbox.is_empty(), "{:?}", r.inbox);
        // Rogue data on a connection beyond the advertised credit resets it.
        let (_s, local) = r.establish(40, BUF_ALLOC);
        let chunk = vec![0u8; MAX_PKT_LEN];
        // The host side reads nothing; the socket buffer and then the
        // device's buffer fill up; the guest keeps sending.
        for _ in 0..(2 * BUF_ALLOC as usize / MAX_PKT_LEN + 8) {
            r.send(guest_hdr(40, local, OP_RW), &chunk);
            if r.inbox.iter().any(|(h, _)| h.op == OP_RST) {
                break;
            }
        }
        let (h, _) = r.expect("reset", |h| h.op == OP_RST);
        assert_eq!(h.src_port, local);
    }
}
