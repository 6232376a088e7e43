//! The host side of the vsock device: the Unix listener, the `CONNECT
//! <port>` handshake, the map of connections and the epoll instance the VM's
//! device thread polls.
//!
//! All host-side descriptors (the listener, every connection's stream and a
//! timer for deadlines) sit in the muxer's own epoll instance. A stream is in
//! that set only while the muxer can act on it: a stream with data waiting
//! for a receive buffer or for guest credit is taken out, so the set is not
//! readable while the guest posts no receive buffers. Packets for the guest
//! come from the connections that owe some, in turn (the receive queue), and
//! from a bounded queue of resets and final shutdowns for connections
//! already gone.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use super::connection::{Conn, Step, Verdict, EV_ERR, EV_HUP, EV_IN, EV_OUT};
use super::packet::{
    Hdr, Packet, HOST_CID, OP_REQUEST, OP_RST, OP_SHUTDOWN, SHUTDOWN_RCV, SHUTDOWN_SEND,
    TYPE_STREAM,
};
use super::uds;
use crate::error::{Error, Result};

/// Most connections at once, handshakes included.
const MAX_CONNS: usize = 1024;
/// Most packets queued for connections already gone (resets, shutdowns).
const MAX_CTRL: usize = 4096;
/// First local port of host-initiated connections.
pub const FIRST_HOST_PORT: u32 = 1 << 30;
/// How long the listener rests after `accept` failed (out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

const TOKEN_LISTENER: u64 = 0;
const TOKEN_TIMER: u64 = 1;
const FIRST_CONN_TOKEN: u64 = 2;

/// The host side of one vsock device.
pub struct Muxer {
    /// The guest's context id.
    cid: u64,
    path: PathBuf,
    /// Device and inode of the socket file, to remove only our own on drop.
    socket_id: (u64, u64),
    listener: UnixListener,
    epoll: Epoll,
    timer: TimerFd,
    /// Handshake deadlines, and how long a closing connection may linger.
    timeout: Duration,
    listener_paused_until: Option<Instant>,
    conns: HashMap<u64, Conn>,
    /// (host port, guest port) to connection token.
    by_key: HashMap<(u32, u32), u64>,
    host_ports: HashSet<u32>,
    next_token: u64,
    next_port: u32,
    /// Connections owing the guest packets, in turn.
    rxq: VecDeque<u64>,
    /// Packets for connections already gone.
    ctrl: VecDeque<Hdr>,
}

impl Muxer {
    /// Listens on `uds_path` for host clients of the guest with context id
    /// `cid` (a stale socket there is replaced; any other file is an error).
    pub fn new(cid: u64, uds_path: &Path, timeout: Duration) -> Result<Muxer> {
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
        Ok(Muxer {
            cid,
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
        })
    }

    /// The epoll descriptor the device thread polls.
    pub fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Open connections, handshakes included.
    #[cfg(test)]
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Whether packets wait for the guest's receive buffers.
    pub fn has_packets(&self) -> bool {
        !self.ctrl.is_empty() || !self.rxq.is_empty()
    }

    /// Connections and queues, for diagnostics.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "{} connections, {} queued for rx, {} control packets, next port {}",
            self.conns.len(),
            self.rxq.len(),
            self.ctrl.len(),
            self.next_port
        );
        for c in self.conns.values() {
            out.push_str(&format!(
                "; {}->{} {} tx {} rx {} fwd {} peer credit {}/{}",
                c.local,
                c.peer,
                c.state.name(),
                c.credit.tx_cnt,
                c.credit.rx_cnt,
                c.credit.fwd_cnt,
                c.credit.peer_fwd_cnt,
                c.credit.peer_buf_alloc
            ));
        }
        out
    }

    /// Guest data held for host streams, over all connections.
    #[cfg(test)]
    pub fn held_bytes(&self) -> usize {
        self.conns.values().map(Conn::held_len).sum()
    }

    fn linger(&self) -> Instant {
        Instant::now() + self.timeout
    }

    fn insert(&mut self, conn: Conn) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        self.conns.insert(token, conn);
        token
    }

    fn enqueue(&mut self, token: u64) {
        if let Some(c) = self.conns.get_mut(&token) {
            if c.owes() && !c.queued {
                c.queued = true;
                self.rxq.push_back(token);
            }
        }
    }

    fn push_ctrl(&mut self, hdr: Hdr) {
        if self.ctrl.len() >= MAX_CTRL {
            tracing::warn!(
                "vsock: control queue full, dropping op {} to guest port {}",
                hdr.op.get(),
                hdr.dst_port.get()
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
        if !conn.in_handshake() {
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
            if !conn.in_handshake() {
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
            h.flags = (SHUTDOWN_RCV | SHUTDOWN_SEND).into();
            self.push_ctrl(h);
        }
    }

    fn host_eof(&mut self, token: u64) {
        let linger = self.linger();
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        if uds::hung_up(conn.fd()) {
            self.host_gone(token);
        } else {
            conn.host_eof(linger);
            self.enqueue(token);
            self.settle(token);
        }
    }

    /// Ends a connection both of whose directions are done.
    fn settle(&mut self, token: u64) {
        if self.conns.get(&token).is_some_and(Conn::finished) {
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
                    let conn = Conn::from_host(stream, self.linger());
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
                let deadline = self.linger();
                let Some(conn) = self.conns.get_mut(&token) else {
                    return;
                };
                conn.request(local, port, deadline);
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
        if conn.in_handshake() {
            self.handshake(token);
            return;
        }
        if !conn.is_open() {
            return;
        }
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
            conn.data_ready();
            self.enqueue(token);
        } else if reg & (EV_IN | EV_OUT) == 0 && hup {
            self.host_gone(token);
        }
    }

    fn guest_connect(&mut self, h: &Hdr) {
        if self.conns.len() >= MAX_CONNS || h.dst_port.get() == u32::MAX {
            self.push_ctrl(h.reset_reply());
            return;
        }
        let mut path = self.path.clone().into_os_string();
        path.push(format!("_{}", h.dst_port.get()));
        let path = PathBuf::from(path);
        match uds::connect_nonblocking(&path) {
            Ok(stream) => {
                let conn = Conn::from_guest(stream, h);
                let key = (conn.local, conn.peer);
                let token = self.insert(conn);
                self.by_key.insert(key, token);
                self.enqueue(token);
            }
            Err(e) => {
                tracing::debug!("vsock: guest connection to {}: {e}", path.display());
                self.push_ctrl(h.reset_reply());
            }
        }
    }

    /// A packet the guest sent.
    pub fn guest_packet(&mut self, p: &Packet) {
        let h = &p.hdr;
        if h.kind.get() != TYPE_STREAM {
            tracing::debug!("vsock: dropping packet of type {}", h.kind.get());
            return;
        }
        if h.src_cid.get() != self.cid {
            tracing::debug!("vsock: dropping packet from CID {}", h.src_cid.get());
            return;
        }
        let op = h.op.get();
        if h.dst_cid.get() != HOST_CID {
            if op != OP_RST {
                self.push_ctrl(h.reset_reply());
            }
            return;
        }
        let Some(&token) = self.by_key.get(&(h.dst_port.get(), h.src_port.get())) else {
            match op {
                OP_REQUEST => self.guest_connect(h),
                OP_RST => {}
                _ => self.push_ctrl(h.reset_reply()),
            }
            return;
        };
        let linger = self.linger();
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        match conn.on_guest(h, &p.payload, linger) {
            Verdict::Keep => {}
            Verdict::Reset => self.reset_conn(token),
            Verdict::Forget => {
                self.remove(token);
            }
        }
        self.enqueue(token);
        self.settle(token);
    }

    /// The next packet for the guest, for a receive buffer with `room`
    /// bytes of payload space; `None` when nothing is owed.
    pub fn next_packet(&mut self, room: usize) -> Option<Packet> {
        loop {
            if let Some(hdr) = self.ctrl.pop_front() {
                return Some(Packet {
                    hdr,
                    payload: Vec::new(),
                });
            }
            let token = self.rxq.pop_front()?;
            let Some(conn) = self.conns.get_mut(&token) else {
                continue;
            };
            conn.queued = false;
            match conn.take_packet(self.cid, room) {
                Step::Packet(hdr, payload) => {
                    self.enqueue(token);
                    return Some(Packet { hdr, payload });
                }
                Step::Nothing => {}
                Step::Eof => self.host_eof(token),
                Step::Fail(e) => {
                    tracing::debug!("vsock: reading host stream: {e}");
                    self.reset_conn(token);
                }
            }
        }
    }

    /// Serves what the epoll reports: new clients, handshakes, stream
    /// readiness.
    pub fn process_events(&mut self) {
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
                // Deadlines are checked on every call; re-arming the timer
                // makes it unreadable again.
                TOKEN_TIMER => {}
                token => self.conn_event(token, ev.events()),
            }
        }
    }

    /// Ends connections whose deadline passed, and resumes a resting
    /// listener.
    pub fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline().is_some_and(|d| d <= now))
            .map(|(t, _)| *t)
            .collect();
        for token in expired {
            let Some(conn) = self.conns.get(&token) else {
                continue;
            };
            tracing::debug!(
                "vsock: connection to guest port {} timed out in state {}",
                conn.peer,
                conn.state.name()
            );
            if conn.known_to_guest() {
                self.reset_conn(token);
            } else {
                self.remove(token);
            }
        }
        if self.listener_paused_until.is_some_and(|t| t <= now) {
            self.resume_listener();
        }
    }

    /// Brings every stream's epoll registration in line with what the
    /// muxer waits for.
    pub fn sync(&mut self) {
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

    /// Arms the timer for the nearest deadline, or disarms it.
    pub fn rearm_timer(&mut self, now: Instant) {
        let next = self
            .conns
            .values()
            .filter_map(Conn::deadline)
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

    /// Drops every connection and every packet owed to the guest.
    pub fn drop_all(&mut self) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for token in tokens {
            self.remove(token);
        }
        self.rxq.clear();
        self.ctrl.clear();
    }
}

impl Drop for Muxer {
    fn drop(&mut self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.socket_id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}
