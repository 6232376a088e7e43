//! One vsock connection: its state machine, the packets it owes the guest,
//! and its credit accounting.
//!
//! A connection starts in [`ConnState::Handshake`] when a host client
//! connects to the device's socket, or in [`ConnState::Established`] when the
//! guest asks to connect to a host socket that accepts it. From there each
//! direction closes on its own (the host stream reaching end of file or the
//! guest's `SHUTDOWN` flags); once neither carries data and the guest data
//! the host stream had not taken yet is written, the connection is over.
//!
//! ```text
//! Handshake --CONNECT line--> AwaitResponse --guest RESPONSE--> Established
//! Established --host EOF / guest SHUTDOWN_RCV--> ToHostOnly
//! Established --guest SHUTDOWN_SEND--> ToGuestOnly
//! ToHostOnly / ToGuestOnly --the other direction closes--> Draining --held data written--> over
//! ```

use std::io::{self, Read};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use super::packet::{
    Hdr, HOST_CID, MAX_PKT_LEN, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE,
    OP_RST, OP_RW, OP_SHUTDOWN, SHUTDOWN_RCV, SHUTDOWN_SEND,
};
use super::uds::{self, MAX_HANDSHAKE};
use vmm_sys_util::epoll::EventSet;

/// Epoll event bits, as [`Conn::interest`] and the muxer's registrations use them.
pub const EV_IN: u32 = EventSet::IN.bits();
/// See [`EV_IN`].
pub const EV_OUT: u32 = EventSet::OUT.bits();
/// See [`EV_IN`].
pub const EV_HUP: u32 = EventSet::HANG_UP.bits();
/// See [`EV_IN`].
pub const EV_ERR: u32 = EventSet::ERROR.bits();

/// Receive buffer each connection advertises to the guest: guest data the
/// host stream has not taken yet is held up to this much.
pub const BUF_ALLOC: u32 = 256 * 1024;

/// Where a connection is in its life, with what that state needs. `held`
/// is guest data the host stream could not take yet.
#[derive(Debug)]
pub enum ConnState {
    /// A host client is writing its `CONNECT <port>` line.
    Handshake {
        /// The line read so far.
        line: Vec<u8>,
        /// When the client must have finished it.
        deadline: Instant,
    },
    /// The guest was asked to accept a host-initiated connection.
    AwaitResponse {
        /// When the guest must have answered.
        deadline: Instant,
    },
    /// Data flows both ways.
    Established {
        /// Guest data for the host stream.
        held: Vec<u8>,
    },
    /// Nothing more for the guest (the host stream reached end of file, or
    /// the guest receives no more); the guest may still send.
    ToHostOnly {
        /// Guest data for the host stream.
        held: Vec<u8>,
    },
    /// The guest sends no more; host data still flows to it. The stream's
    /// write side is shut once `held` is written.
    ToGuestOnly {
        /// Guest data for the host stream.
        held: Vec<u8>,
    },
    /// Neither direction carries new data; `held` drains into the host
    /// stream until `deadline`, then the connection is reset.
    Draining {
        /// Guest data for the host stream.
        held: Vec<u8>,
        /// When the host must have taken it.
        deadline: Instant,
    },
}

impl ConnState {
    /// A short name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            ConnState::Handshake { .. } => "Handshake",
            ConnState::AwaitResponse { .. } => "AwaitResponse",
            ConnState::Established { .. } => "Established",
            ConnState::ToHostOnly { .. } => "ToHostOnly",
            ConnState::ToGuestOnly { .. } => "ToGuestOnly",
            ConnState::Draining { .. } => "Draining",
        }
    }

    fn held(&self) -> Option<&Vec<u8>> {
        match self {
            ConnState::Handshake { .. } | ConnState::AwaitResponse { .. } => None,
            ConnState::Established { held }
            | ConnState::ToHostOnly { held }
            | ConnState::ToGuestOnly { held }
            | ConnState::Draining { held, .. } => Some(held),
        }
    }

    fn held_mut(&mut self) -> Option<&mut Vec<u8>> {
        match self {
            ConnState::Handshake { .. } | ConnState::AwaitResponse { .. } => None,
            ConnState::Established { held }
            | ConnState::ToHostOnly { held }
            | ConnState::ToGuestOnly { held }
            | ConnState::Draining { held, .. } => Some(held),
        }
    }

    /// Host data may still go to the guest.
    fn to_guest_open(&self) -> bool {
        matches!(
            self,
            ConnState::Established { .. } | ConnState::ToGuestOnly { .. }
        )
    }

    /// The guest may still send data.
    fn to_host_open(&self) -> bool {
        matches!(
            self,
            ConnState::Established { .. } | ConnState::ToHostOnly { .. }
        )
    }

    /// Closes direction `dir`; `linger` is the deadline should the
    /// connection start draining.
    fn close(&mut self, dir: Direction, linger: Instant) {
        let next = match (dir, &mut *self) {
            (Direction::ToGuest, ConnState::Established { held }) => ConnState::ToHostOnly {
                held: std::mem::take(held),
            },
            (Direction::ToHost, ConnState::Established { held }) => ConnState::ToGuestOnly {
                held: std::mem::take(held),
            },
            (Direction::ToGuest, ConnState::ToGuestOnly { held })
            | (Direction::ToHost, ConnState::ToHostOnly { held }) => ConnState::Draining {
                held: std::mem::take(held),
                deadline: linger,
            },
            _ => return,
        };
        *self = next;
    }
}

/// One direction of a connection's data.
#[derive(Clone, Copy, Debug)]
enum Direction {
    /// From the host stream to the guest.
    ToGuest,
    /// From the guest to the host stream.
    ToHost,
}

/// A packet a connection owes the guest; sent in this order when a
/// receive buffer is there to take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owed {
    Request = 1 << 0,
    Response = 1 << 1,
    ShutdownSend = 1 << 2,
    /// The host stream may have data for the guest.
    Data = 1 << 3,
    CreditUpdate = 1 << 4,
}

/// A set of [`Owed`] packets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct OwedSet(u8);

impl OwedSet {
    fn insert(&mut self, o: Owed) {
        self.0 |= o as u8;
    }

    fn remove(&mut self, o: Owed) {
        self.0 &= !(o as u8);
    }

    fn contains(self, o: Owed) -> bool {
        self.0 & o as u8 != 0
    }

    /// Removes `o`, returning whether it was there.
    fn take(&mut self, o: Owed) -> bool {
        let had = self.contains(o);
        self.remove(o);
        had
    }
}

/// Credit-based flow control: what each side may still send.
#[derive(Clone, Copy, Debug, Default)]
pub struct Credit {
    /// The guest's receive buffer for this connection.
    pub peer_buf_alloc: u32,
    /// Bytes the guest has taken out of it.
    pub peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    pub tx_cnt: u32,
    /// Bytes received from the guest.
    pub rx_cnt: u32,
    /// Bytes of guest data written to the host stream.
    pub fwd_cnt: u32,
    /// `fwd_cnt` as last told to the guest.
    last_fwd_cnt_sent: u32,
}

impl Credit {
    /// Bytes the guest can take now.
    fn peer_free(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Whether the guest should hear of our credit: its view of our free
    /// buffer has shrunk to half and some of it was freed since.
    fn update_due(&self) -> bool {
        let unacked = self.rx_cnt.wrapping_sub(self.last_fwd_cnt_sent);
        self.fwd_cnt != self.last_fwd_cnt_sent && unacked >= BUF_ALLOC / 2
    }
}

/// What a connection has for the guest when a receive buffer is there.
pub enum Step {
    /// A packet to deliver.
    Packet(Hdr, Vec<u8>),
    /// Nothing owed any more.
    Nothing,
    /// The host stream reached end of file.
    Eof,
    /// Reading the host stream failed.
    Fail(io::Error),
}

/// What the muxer does with a connection after a guest packet.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It lives on.
    Keep,
    /// Drop it and reset it on the guest's side.
    Reset,
    /// Drop it silently (the guest reset it).
    Forget,
}

/// One connection between a host Unix stream and a guest port.
pub struct Conn {
    /// The host side's stream.
    pub stream: UnixStream,
    /// Where the connection is.
    pub state: ConnState,
    /// Host-side port.
    pub local: u32,
    /// Guest-side port.
    pub peer: u32,
    /// Started by a host client (its port is from the muxer's range).
    pub host_initiated: bool,
    /// Flow-control counters.
    pub credit: Credit,
    /// Events the stream is registered for in the muxer's epoll (0: not in it).
    pub registered: u32,
    /// Whether the connection sits in the muxer's receive queue.
    pub queued: bool,
    owed: OwedSet,
}

impl Conn {
    /// A host client's connection, expected to send its `CONNECT` line by
    /// `deadline`.
    pub fn from_host(stream: UnixStream, deadline: Instant) -> Conn {
        Conn::new(
            stream,
            ConnState::Handshake {
                line: Vec::new(),
                deadline,
            },
        )
    }

    /// The guest's connection request `req`, accepted by the host socket
    /// behind `stream`; owes the guest its response.
    pub fn from_guest(stream: UnixStream, req: &Hdr) -> Conn {
        let mut c = Conn::new(stream, ConnState::Established { held: Vec::new() });
        c.local = req.dst_port.get();
        c.peer = req.src_port.get();
        c.credit.peer_buf_alloc = req.buf_alloc.get();
        c.credit.peer_fwd_cnt = req.fwd_cnt.get();
        c.owed.insert(Owed::Response);
        c
    }

    fn new(stream: UnixStream, state: ConnState) -> Conn {
        Conn {
            stream,
            state,
            local: 0,
            peer: 0,
            host_initiated: false,
            credit: Credit::default(),
            registered: 0,
            queued: false,
            owed: OwedSet::default(),
        }
    }

    /// The host stream's descriptor.
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// The deadline the connection's state runs against, if any.
    pub fn deadline(&self) -> Option<Instant> {
        match self.state {
            ConnState::Handshake { deadline, .. }
            | ConnState::AwaitResponse { deadline }
            | ConnState::Draining { deadline, .. } => Some(deadline),
            _ => None,
        }
    }

    /// Whether the guest has heard of this connection.
    pub fn known_to_guest(&self) -> bool {
        !self.in_handshake() && !self.owed.contains(Owed::Request)
    }

    /// Whether a host client is still writing its `CONNECT` line.
    pub fn in_handshake(&self) -> bool {
        matches!(self.state, ConnState::Handshake { .. })
    }

    /// Whether the connection is past both handshakes.
    pub fn is_open(&self) -> bool {
        self.state.held().is_some()
    }

    /// Bytes of guest data held for the host stream.
    pub fn held_len(&self) -> usize {
        self.state.held().map_or(0, Vec::len)
    }

    /// Whether both directions are done and nothing is left to write.
    pub fn finished(&self) -> bool {
        matches!(&self.state, ConnState::Draining { held, .. } if held.is_empty())
    }

    /// Whether the connection owes the guest a packet.
    pub fn owes(&self) -> bool {
        self.owed != OwedSet::default()
    }

    /// The host stream may have data for the guest.
    pub fn data_ready(&mut self) {
        self.owed.insert(Owed::Data);
    }

    /// A header for a packet to the guest with context id `cid`, carrying
    /// this side's credit.
    pub fn packet(&mut self, cid: u64, op: u16) -> Hdr {
        self.credit.last_fwd_cnt_sent = self.credit.fwd_cnt;
        self.owed.remove(Owed::CreditUpdate);
        let mut h = Hdr::stream((HOST_CID, self.local), (cid, self.peer), op);
        h.buf_alloc = BUF_ALLOC.into();
        h.fwd_cnt = self.credit.fwd_cnt.into();
        h
    }

    /// The events the muxer waits for on this stream now.
    pub fn interest(&self) -> u32 {
        let Some(held) = self.state.held() else {
            return match self.state {
                ConnState::Handshake { .. } => EV_IN,
                _ => 0,
            };
        };
        let to_guest = self.state.to_guest_open();
        let mut ev = 0;
        if to_guest && !self.owed.contains(Owed::Data) && self.credit.peer_free() > 0 {
            ev |= EV_IN;
        }
        if !held.is_empty() {
            ev |= EV_OUT;
        }
        if ev == 0 && !to_guest {
            // Nothing more to read: only notice the host closing.
            ev = EV_HUP;
        }
        ev
    }

    fn check_credit(&mut self) {
        if self.credit.update_due() {
            self.owed.insert(Owed::CreditUpdate);
        }
    }

    /// Takes guest data for the host stream; an error means the connection
    /// is beyond repair (host gone, or the guest overran its credit).
    fn forward(&mut self, data: &[u8]) -> io::Result<()> {
        let fd = self.fd();
        let Some(held) = self.state.held_mut() else {
            return Err(io::Error::other("data on a connection not established"));
        };
        self.credit.rx_cnt = self.credit.rx_cnt.wrapping_add(data.len() as u32);
        let written = if held.is_empty() {
            uds::send_some(fd, data)?
        } else {
            0
        };
        let rest = &data[written..];
        if held.len() + rest.len() > BUF_ALLOC as usize {
            return Err(io::Error::other("guest overran its credit"));
        }
        held.extend_from_slice(rest);
        self.credit.fwd_cnt = self.credit.fwd_cnt.wrapping_add(written as u32);
        self.check_credit();
        Ok(())
    }

    /// Writes held guest data to the host stream.
    pub fn flush(&mut self) -> io::Result<()> {
        let fd = self.fd();
        let guest_done = !self.state.to_host_open();
        let Some(held) = self.state.held_mut() else {
            return Ok(());
        };
        let n = uds::send_some(fd, held)?;
        held.drain(..n);
        let empty = held.is_empty();
        self.credit.fwd_cnt = self.credit.fwd_cnt.wrapping_add(n as u32);
        self.check_credit();
        if empty && guest_done {
            // The host may have closed its end already.
            let _ = self.stream.shutdown(Shutdown::Write);
        }
        Ok(())
    }

    /// The next packet for the guest with context id `cid`, `room` being
    /// the payload space of the receive buffer at hand.
    pub fn take_packet(&mut self, cid: u64, room: usize) -> Step {
        if self.owed.take(Owed::Request) {
            return Step::Packet(self.packet(cid, OP_REQUEST), Vec::new());
        }
        if self.owed.take(Owed::Response) {
            return Step::Packet(self.packet(cid, OP_RESPONSE), Vec::new());
        }
        if self.owed.take(Owed::ShutdownSend) {
            let mut h = self.packet(cid, OP_SHUTDOWN);
            h.flags = SHUTDOWN_SEND.into();
            return Step::Packet(h, Vec::new());
        }
        if self.owed.contains(Owed::Data) {
            let free = self.credit.peer_free() as usize;
            if !self.state.to_guest_open() || free == 0 {
                self.owed.remove(Owed::Data);
            } else if room > 0 {
                let mut buf = vec![0u8; room.min(free).min(MAX_PKT_LEN)];
                loop {
                    match (&self.stream).read(&mut buf) {
                        Ok(0) => return Step::Eof,
                        Ok(n) => {
                            buf.truncate(n);
                            self.credit.tx_cnt = self.credit.tx_cnt.wrapping_add(n as u32);
                            let mut h = self.packet(cid, OP_RW);
                            h.len = (n as u32).into();
                            return Step::Packet(h, buf);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            self.owed.remove(Owed::Data);
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
        if self.owed.contains(Owed::CreditUpdate) {
            return Step::Packet(self.packet(cid, OP_CREDIT_UPDATE), Vec::new());
        }
        Step::Nothing
    }

    /// Reads what the host client sent of its handshake, never past the
    /// line's end (bytes after it belong to the connection); returns the
    /// guest port once the line is complete.
    pub fn read_line(&mut self) -> Result<Option<u32>, String> {
        let fd = self.fd();
        let ConnState::Handshake { line, .. } = &mut self.state else {
            return Err("not in the handshake".into());
        };
        let mut buf = [0u8; MAX_HANDSHAKE + 1];
        let want = MAX_HANDSHAKE + 1 - line.len();
        let n = match uds::recv(fd, &mut buf[..want], libc::MSG_PEEK) {
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
        match uds::recv(fd, &mut buf[..take], 0) {
            Ok(got) if got == take => {}
            Ok(got) => return Err(format!("read {got} of {take} peeked bytes")),
            Err(e) => return Err(format!("reading the handshake: {e}")),
        }
        line.extend_from_slice(&buf[..take]);
        if line.len() > MAX_HANDSHAKE {
            return Err(format!("handshake longer than {MAX_HANDSHAKE} bytes"));
        }
        if line.last() != Some(&b'\n') {
            return Ok(None);
        }
        uds::parse_connect(line)
            .map(Some)
            .ok_or_else(|| format!("bad handshake {:?}", String::from_utf8_lossy(line)))
    }

    /// The host client asked for guest port `peer`; the connection is
    /// `local` on the host side and owes the guest a request, which it must
    /// answer by `deadline`.
    pub fn request(&mut self, local: u32, peer: u32, deadline: Instant) {
        self.local = local;
        self.peer = peer;
        self.host_initiated = true;
        self.state = ConnState::AwaitResponse { deadline };
        self.owed.insert(Owed::Request);
        // The guest has not given its credit yet.
        self.credit.peer_buf_alloc = 0;
    }

    /// The guest accepted a host-initiated connection: the host client is
    /// told its port.
    fn accept(&mut self) -> Verdict {
        let line = format!("OK {}\n", self.local);
        match uds::send(self.fd(), line.as_bytes()) {
            Ok(n) if n == line.len() => {
                self.state = ConnState::Established { held: Vec::new() };
                self.owed.remove(Owed::Request);
                Verdict::Keep
            }
            Ok(_) => {
                tracing::debug!("vsock: host stream took part of the handshake answer");
                Verdict::Reset
            }
            Err(e) => {
                tracing::debug!("vsock: answering the host handshake: {e}");
                Verdict::Reset
            }
        }
    }

    /// The host stream reached end of file but is still open for writing:
    /// the guest is told the host sends no more.
    pub fn host_eof(&mut self, linger: Instant) {
        self.owed.remove(Owed::Data);
        self.owed.insert(Owed::ShutdownSend);
        self.state.close(Direction::ToGuest, linger);
    }

    /// The guest's `SHUTDOWN` with `flags`; `linger` bounds the draining of
    /// held data.
    fn guest_shutdown(&mut self, flags: u32, linger: Instant) {
        if flags & SHUTDOWN_RCV != 0 {
            self.owed.remove(Owed::Data);
            let _ = self.stream.shutdown(Shutdown::Read);
            self.state.close(Direction::ToGuest, linger);
        }
        if flags & SHUTDOWN_SEND != 0 {
            if self.held_len() == 0 {
                let _ = self.stream.shutdown(Shutdown::Write);
            }
            self.state.close(Direction::ToHost, linger);
        }
    }

    /// A packet from the guest for this connection; `linger` is the
    /// deadline for a connection that starts draining.
    pub fn on_guest(&mut self, h: &Hdr, payload: &[u8], linger: Instant) -> Verdict {
        self.credit.peer_buf_alloc = h.buf_alloc.get();
        self.credit.peer_fwd_cnt = h.fwd_cnt.get();
        let op = h.op.get();
        match (&self.state, op) {
            (_, OP_RST) => Verdict::Forget,
            (ConnState::AwaitResponse { .. }, OP_RESPONSE) => self.accept(),
            (s, OP_RW) if s.held().is_some() => {
                if !s.to_host_open() {
                    tracing::debug!("vsock: dropping data sent after the guest's shutdown");
                    Verdict::Keep
                } else if let Err(e) = self.forward(payload) {
                    tracing::debug!("vsock: guest data to host stream: {e}");
                    Verdict::Reset
                } else {
                    Verdict::Keep
                }
            }
            (s, OP_CREDIT_UPDATE) if s.held().is_some() => Verdict::Keep,
            (s, OP_CREDIT_REQUEST) if s.held().is_some() => {
                self.owed.insert(Owed::CreditUpdate);
                Verdict::Keep
            }
            (s, OP_SHUTDOWN) if s.held().is_some() => {
                self.guest_shutdown(h.flags.get(), linger);
                Verdict::Keep
            }
            (state, op) => {
                tracing::debug!(
                    "vsock: unexpected op {op} on a connection in state {}",
                    state.name()
                );
                Verdict::Reset
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Conn, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let req = Hdr {
            buf_alloc: 1000.into(),
            ..Hdr::stream((3, 50), (HOST_CID, 60), OP_REQUEST)
        };
        (Conn::from_guest(a, &req), b)
    }

    #[test]
    fn each_direction_closes_on_its_own_and_drains_last() {
        let now = Instant::now();
        let (mut c, _peer) = pair();
        assert_eq!(c.state.name(), "Established");
        let shut = |flags: u32| Hdr {
            flags: flags.into(),
            ..Hdr::stream((3, 50), (HOST_CID, 60), OP_SHUTDOWN)
        };
        assert_eq!(c.on_guest(&shut(SHUTDOWN_SEND), &[], now), Verdict::Keep);
        assert_eq!(c.state.name(), "ToGuestOnly");
        let rw = Hdr::stream((3, 50), (HOST_CID, 60), OP_RW);
        assert_eq!(c.on_guest(&rw, b"late", now), Verdict::Keep);
        assert_eq!(c.credit.rx_cnt, 0, "data after SHUTDOWN_SEND is dropped");
        c.host_eof(now);
        assert_eq!(c.state.name(), "Draining");
        assert_eq!(c.deadline(), Some(now));
        assert!(c.finished());
    }

    #[test]
    fn credit_limits_what_the_guest_is_sent() {
        let (mut c, mut peer) = pair();
        // The response comes first and carries our credit.
        let Step::Packet(h, _) = c.take_packet(3, 4096) else {
            panic!("no response");
        };
        assert_eq!((h.op.get(), h.buf_alloc.get()), (OP_RESPONSE, BUF_ALLOC));
        std::io::Write::write_all(&mut peer, &[7u8; 3000]).unwrap();
        c.data_ready();
        let Step::Packet(h, data) = c.take_packet(3, 4096) else {
            panic!("no data");
        };
        assert_eq!(
            (h.op.get(), data.len()),
            (OP_RW, 1000),
            "the guest's 1000 bytes"
        );
        c.data_ready();
        assert!(matches!(c.take_packet(3, 4096), Step::Nothing));
        assert_eq!(c.interest(), 0, "no credit: not reading the stream");
    }
}
