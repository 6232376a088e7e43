use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use zerocopy::{FromBytes, IntoBytes};

use super::connection::BUF_ALLOC;
use super::muxer::FIRST_HOST_PORT;
use super::packet::*;
use super::*;
use crate::memory::GuestRam;
use crate::virtio::testing::FakeQueue;

const CID: u64 = 42;
const QSIZE: u16 = 256;
/// Bytes behind each descriptor of the fake driver.
const SLOT: u64 = 0x11000;
const WAIT: Duration = Duration::from_secs(5);

/// A device, guest memory with the three queues and a fake driver.
struct Rig {
    _ram: GuestRam,
    mem: GuestMem,
    queues: Vec<Queue>,
    vqs: Vec<FakeQueue>,
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
    let region = FakeQueue::footprint(QSIZE, SLOT);
    let ram = GuestRam::reserve(3 * region as usize).unwrap();
    let mem = ram.memory().clone();
    let vqs: Vec<FakeQueue> = (0..3)
        .map(|i| FakeQueue::new(i * region, QSIZE, SLOT))
        .collect();
    let queues = vqs.iter().map(FakeQueue::queue).collect();
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
        buf_alloc: BUF_ALLOC.into(),
        ..Hdr::stream((CID, src_port), (HOST_CID, dst_port), op)
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
            self.vqs[RX].post_bytes(&self.mem, &[(44, true, &[]), (4096, true, &[])]);
        }
        self.process(RX);
        self.collect();
    }

    /// Sends one packet, header and payload in separate descriptors.
    fn send(&mut self, h: Hdr, payload: &[u8]) {
        let h = Hdr {
            len: (payload.len() as u32).into(),
            ..h
        };
        let bytes = h.as_bytes();
        if payload.is_empty() {
            self.send_raw(&[(44, false, bytes)]);
        } else {
            self.send_raw(&[(44, false, bytes), (payload.len() as u32, false, payload)]);
        }
    }

    fn send_raw(&mut self, descs: &[(u32, bool, &[u8])]) {
        self.vqs[TX].post_bytes(&self.mem, descs);
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
            let h = Hdr::read_from_prefix(&data).unwrap().0;
            assert_eq!(h.len.get() as usize, data.len() - HDR_LEN, "{h:?}");
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
        let (h, _) = self.expect("request", |h| h.op.get() == OP_REQUEST);
        (s, h)
    }

    /// A host-initiated connection the guest accepted with `buf_alloc`.
    fn establish(&mut self, port: u32, buf_alloc: u32) -> (UnixStream, u32) {
        self.post_rx(16);
        let (mut s, req) = self.host_connect(port);
        assert_eq!(
            (
                req.src_cid.get(),
                req.dst_cid.get(),
                req.dst_port.get(),
                req.kind.get()
            ),
            (HOST_CID, CID, port, TYPE_STREAM)
        );
        assert!(req.src_port.get() >= FIRST_HOST_PORT);
        let resp = Hdr {
            buf_alloc: buf_alloc.into(),
            ..guest_hdr(port, req.src_port.get(), OP_RESPONSE)
        };
        self.send(resp, &[]);
        let line = self.read_host(&mut s, format!("OK {}\n", req.src_port.get()).len());
        assert_eq!(line, format!("OK {}\n", req.src_port.get()).into_bytes());
        (s, req.src_port.get())
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
        let posted = self.vqs[RX].in_flight();
        s.write_all(&vec![1u8; posted as usize * 4096]).unwrap();
        let mut n = 0;
        while n < posted as usize * 4096 {
            let (_, data) = self.expect("data", |h| h.op.get() == OP_RW);
            n += data.len();
        }
        assert_eq!(self.vqs[RX].in_flight(), 0);
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
            let (h, data) = self.expect("data", |h| h.op.get() == OP_RW);
            assert_eq!((h.src_port.get(), h.dst_port.get()), (local, peer));
            assert!(data.len() <= 4096);
            out.extend_from_slice(&data);
            // Consume and acknowledge.
            let upd = Hdr {
                buf_alloc: buf_alloc.into(),
                fwd_cnt: ((consumed + out.len()) as u32).into(),
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
        while let Some(i) = r.inbox.iter().position(|(h, _)| h.op.get() == OP_RW) {
            let (h, data) = r.inbox.remove(i).unwrap();
            assert_eq!(
                (h.src_port.get(), h.dst_port.get(), h.dst_cid.get()),
                (local, 1234, CID)
            );
            assert_eq!(h.buf_alloc.get(), BUF_ALLOC);
            got.extend_from_slice(&data);
        }
    }
    assert_eq!(got.len(), window as usize, "no more than the credit");
    for _ in 0..5 {
        r.pump(10);
    }
    assert!(
        r.inbox.iter().all(|(h, _)| h.op.get() != OP_RW),
        "data beyond the credit"
    );
    // The guest consumed it all; the rest follows.
    let rest = {
        let upd = Hdr {
            buf_alloc: window.into(),
            fwd_cnt: (got.len() as u32).into(),
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
            let held = r.dev.muxer.held_bytes();
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
            assert_eq!(h.buf_alloc.get(), BUF_ALLOC);
            assert!(
                h.fwd_cnt.get().wrapping_sub(dev_fwd) < 1 << 31,
                "fwd_cnt goes forward"
            );
            dev_fwd = h.fwd_cnt.get();
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
    r.vqs[RX].post_bytes(
        &r.mem,
        &[(10, true, &[]), (20, true, &[]), (100, true, &[])],
    );
    r.process(RX);
    let (h, data) = r.expect("data", |h| h.op.get() == OP_RW);
    assert_eq!(h.src_port.get(), local);
    assert_eq!(data, b"split header");
    // A buffer with room for a header only cannot carry data: it gets a
    // credit update and the data goes into the next buffer.
    s.write_all(b"more").unwrap();
    r.vqs[RX].post_bytes(&r.mem, &[(44, true, &[])]);
    r.vqs[RX].post_bytes(&r.mem, &[(44, true, &[]), (100, true, &[])]);
    r.process(RX);
    let (h, _) = r.expect("credit update", |h| h.op.get() == OP_CREDIT_UPDATE);
    assert_eq!(h.src_port.get(), local);
    let (_, data) = r.expect("data", |h| h.op.get() == OP_RW);
    assert_eq!(data, b"more");
}

#[test]
fn guest_reset_refuses_a_host_connection() {
    let mut r = rig();
    r.post_rx(4);
    let (mut s, req) = r.host_connect(99);
    r.send(guest_hdr(99, req.src_port.get(), OP_RST), &[]);
    r.expect_closed(&mut s);
    assert!(r.dev.muxer.connection_count() == 0);
}

#[test]
fn host_connect_returns_the_stream_once_the_guest_accepts() {
    let mut r = rig();
    r.post_rx(8);
    for (port, answer) in [(1024, OP_RESPONSE), (1025, OP_RST)] {
        let uds = r.uds.clone();
        let client = std::thread::spawn(move || host_connect(&uds, port, Duration::from_secs(10)));
        let (req, _) = r.expect("request", |h| h.op.get() == OP_REQUEST);
        assert_eq!(req.dst_port.get(), port);
        r.send(guest_hdr(port, req.src_port.get(), answer), &[]);
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
    assert!(r.dev.muxer.connection_count() == 0);
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
    let (rst, _) = r.expect("reset", |h| h.op.get() == OP_RST);
    assert_eq!(
        (rst.src_port.get(), rst.dst_port.get()),
        (req.src_port.get(), 77)
    );
    assert!(r.dev.muxer.connection_count() == 0);
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
    let (h, _) = r.expect("response", |h| h.op.get() == OP_RESPONSE);
    assert_eq!(
        (h.src_port.get(), h.dst_port.get(), h.src_cid.get()),
        (5000, 7777, HOST_CID)
    );
    let (mut s, _) = listener.accept().unwrap();
    s.set_nonblocking(true).unwrap();
    r.send(guest_hdr(7777, 5000, OP_RW), b"hello host");
    assert_eq!(r.read_host(&mut s, 10), b"hello host");
    s.write_all(b"hello guest").unwrap();
    let (h, data) = r.expect("data", |h| h.op.get() == OP_RW);
    assert_eq!((h.src_port.get(), h.dst_port.get()), (5000, 7777));
    assert_eq!(data, b"hello guest");
    // A credit request is answered.
    r.send(guest_hdr(7777, 5000, OP_CREDIT_REQUEST), &[]);
    let (h, _) = r.expect("credit update", |h| h.op.get() == OP_CREDIT_UPDATE);
    assert_eq!((h.buf_alloc.get(), h.fwd_cnt.get()), (BUF_ALLOC, 10));
    // Nobody listens on port 5001.
    r.send(guest_hdr(7778, 5001, OP_REQUEST), &[]);
    let (h, _) = r.expect("reset", |h| h.op.get() == OP_RST);
    assert_eq!((h.src_port.get(), h.dst_port.get()), (5001, 7778));
    // Packets for unknown connections are reset, resets are not.
    r.send(guest_hdr(7779, 5000, OP_RW), b"x");
    let (h, _) = r.expect("reset", |h| h.op.get() == OP_RST);
    assert_eq!(h.dst_port.get(), 7779);
    r.send(guest_hdr(7779, 5000, OP_RST), &[]);
    // The guest shuts down its sending side: the host reads EOF; then
    // its receiving side: the connection is over and reset.
    r.send(
        Hdr {
            flags: SHUTDOWN_SEND.into(),
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
    let (_, data) = r.expect("data", |h| h.op.get() == OP_RW);
    assert_eq!(data, b"still open");
    r.send(
        Hdr {
            flags: (SHUTDOWN_RCV | SHUTDOWN_SEND).into(),
            ..guest_hdr(7777, 5000, OP_SHUTDOWN)
        },
        &[],
    );
    let (h, _) = r.expect("reset", |h| h.op.get() == OP_RST);
    assert_eq!(h.dst_port.get(), 7777);
    assert!(r.inbox.is_empty(), "{:?}", r.inbox);
    assert!(r.dev.muxer.connection_count() == 0);
}

#[test]
fn host_disconnects_are_told_to_the_guest() {
    let mut r = rig();
    // Full close, with data still in flight: data first, then shutdown.
    let (mut s, local) = r.establish(10, BUF_ALLOC);
    s.write_all(b"last words").unwrap();
    drop(s);
    let (h, data) = r.expect("data", |h| h.op.get() == OP_RW);
    assert_eq!(
        (h.src_port.get(), data.as_slice()),
        (local, &b"last words"[..])
    );
    let (h, _) = r.expect("shutdown", |h| h.op.get() == OP_SHUTDOWN);
    assert_eq!(h.src_port.get(), local);
    assert_eq!(h.flags.get(), SHUTDOWN_RCV | SHUTDOWN_SEND);
    assert!(r.dev.muxer.connection_count() == 0);
    // The guest's late reset finds nothing and gets no answer.
    r.send(guest_hdr(10, local, OP_RST), &[]);
    assert!(r.inbox.is_empty());

    // Half close: the guest may still answer.
    let (s, local) = r.establish(11, BUF_ALLOC);
    s.shutdown(Shutdown::Write).unwrap();
    let (h, _) = r.expect("shutdown", |h| h.op.get() == OP_SHUTDOWN);
    assert_eq!((h.src_port.get(), h.flags.get()), (local, SHUTDOWN_SEND));
    r.send(guest_hdr(11, local, OP_RW), b"answer");
    let mut s = s;
    assert_eq!(r.read_host(&mut s, 6), b"answer");
    // Then the host goes away entirely.
    drop(s);
    let (h, _) = r.expect("shutdown", |h| h.op.get() == OP_SHUTDOWN);
    assert_eq!(h.flags.get(), SHUTDOWN_RCV | SHUTDOWN_SEND);
    assert!(r.dev.muxer.connection_count() == 0);
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
    let (h, data) = r.expect("data", |h| h.op.get() == OP_RW);
    assert_eq!((h.src_port.get(), data.as_slice()), (local, &b"ping"[..]));
    // ...and the stream is watched again.
    s.write_all(b"pong").unwrap();
    assert!(poll_in(fd, 5000), "host fd re-armed");
    let (_, data) = r.expect("data", |h| h.op.get() == OP_RW);
    assert_eq!(data, b"pong");
}

#[test]
fn restore_drops_connections_and_resets_the_transport() {
    let mut r = rig();
    let (mut s, _) = r.establish(30, BUF_ALLOC);
    let mut pending = UnixStream::connect(&r.uds).unwrap();
    pending.write_all(b"CONN").unwrap();
    r.pump(10);
    assert_eq!(r.dev.muxer.connection_count(), 2);
    // No event buffer yet: the event waits for one.
    assert!(!r.dev.after_restore(&mut r.queues, &r.mem));
    r.expect_closed(&mut s);
    r.expect_closed(&mut pending);
    assert!(r.dev.muxer.connection_count() == 0);
    r.vqs[EVENT].post_bytes(&r.mem, &[(4, true, &[])]);
    assert!(r.process(EVENT));
    let used = r.vqs[EVENT].take_used(&r.mem);
    assert_eq!(
        used,
        vec![(4, EVENT_TRANSPORT_RESET.to_le_bytes().to_vec())]
    );
    // Only one event.
    r.vqs[EVENT].post_bytes(&r.mem, &[(4, true, &[])]);
    r.process(EVENT);
    assert!(r.vqs[EVENT].take_used(&r.mem).is_empty());
    // With a buffer posted, after_restore uses it at once.
    assert!(r.dev.after_restore(&mut r.queues, &r.mem));
    assert_eq!(r.vqs[EVENT].take_used(&r.mem).len(), 1);
    // The listener still works.
    r.establish(31, BUF_ALLOC);
    r.dev.reset();
    assert!(r.dev.muxer.connection_count() == 0);
}

#[test]
fn malformed_packets_are_dropped() {
    let mut r = rig();
    // A receive buffer outside guest memory, first in line.
    r.vqs[RX].post(&r.mem, &[(1 << 40, 4096, true)]);
    r.process(RX);
    let good = guest_hdr(1, 6000, OP_REQUEST);
    // Short header.
    r.send_raw(&[(20, false, &good.as_bytes()[..20])]);
    // Length beyond the descriptors.
    let long = Hdr {
        len: 100.into(),
        ..guest_hdr(1, 6000, OP_RW)
    };
    r.send_raw(&[(44, false, long.as_bytes()), (50, false, &[0u8; 50])]);
    // Length beyond the packet limit.
    let huge = Hdr {
        len: u32::MAX.into(),
        ..guest_hdr(1, 6000, OP_RW)
    };
    r.send_raw(&[(44, false, huge.as_bytes())]);
    // Not a stream.
    let dgram = Hdr {
        kind: 3.into(),
        ..guest_hdr(1, 6000, OP_REQUEST)
    };
    r.send_raw(&[(44, false, dgram.as_bytes())]);
    // Another guest's CID.
    let other = Hdr {
        src_cid: 7.into(),
        ..guest_hdr(1, 6000, OP_REQUEST)
    };
    r.send_raw(&[(44, false, other.as_bytes())]);
    // A descriptor outside guest memory.
    r.vqs[TX].post(&r.mem, &[(1 << 40, 44, false)]);
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
    let (h, _) = r.expect("reset", |h| h.op.get() == OP_RST);
    assert_eq!(h.dst_port.get(), 1);
    assert_eq!(r.empty_rx, 1, "the bad receive buffer came back empty");
    assert!(r.inbox.is_empty(), "{:?}", r.inbox);
    // Rogue data on a connection beyond the advertised credit resets it.
    let (_s, local) = r.establish(40, BUF_ALLOC);
    let chunk = vec![0u8; MAX_PKT_LEN];
    // The host side reads nothing; the socket buffer and then the
    // device's buffer fill up; the guest keeps sending.
    for _ in 0..(2 * BUF_ALLOC as usize / MAX_PKT_LEN + 8) {
        r.send(guest_hdr(40, local, OP_RW), &chunk);
        if r.inbox.iter().any(|(h, _)| h.op.get() == OP_RST) {
            break;
        }
    }
    let (h, _) = r.expect("reset", |h| h.op.get() == OP_RST);
    assert_eq!(h.src_port.get(), local);
}
