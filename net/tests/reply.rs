//! Reply tracking on the host: a real client in the outside namespace,
//! which plays the node (its address is private, and the node's), reaches
//! the pod; the test plays the guest on the tap and answers. With the
//! default policy the answers pass (counted under `reply`), while the guest
//! still cannot start anything towards that address. Only a TCP SYN, an
//! ICMP echo request and a UDP datagram to a port the pod opted in open a
//! reply path: a stray segment or datagram from an address the policy
//! forbids opens nothing. Needs root.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use nix::sched::{setns, CloneFlags};
use twig_net::{
    Action, AttachMode, EgressPolicy, EgressRule, FlowTimeouts, Loader, NodeContext, PodNetwork,
    PortRange, Reason,
};

/// The node's address: the client's source, private.
const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 7);
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 7000;
/// An address the policy forbids (public, under a default deny): a
/// collaborator the guest must not reach.
const FORBIDDEN_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 9);
const TCP_SYN: u8 = 0x02;
const TCP_PSH: u8 = 0x08;
const TCP_ACK: u8 = 0x10;

fn node() -> NodeContext {
    NodeContext {
        node_addrs: vec![NODE_IP],
        cluster_dns: vec![],
    }
}

/// `port` alone, as a UDP reply port.
fn port(port: u16) -> PortRange {
    PortRange {
        port,
        end_port: None,
    }
}

/// Default deny; only the test's peer (for `assert_dropped`'s markers) is
/// allowed.
fn deny_by_default() -> EgressPolicy {
    EgressPolicy {
        default_action: Action::Deny,
        allow: vec![EgressRule::cidr(&format!("{PEER_IP}/32"))],
        deny: vec![],
        udp_reply_ports: vec![],
    }
}

fn loader(mode: AttachMode) -> Loader {
    Loader::with_mode(mode).expect("this kernel runs twig-net in this mode")
}

/// A bed whose outside namespace reaches the pod from `NODE_IP` (a route
/// with that source, and the pod's MAC as a permanent neighbour: the test
/// guest does not answer ARP).
fn node_bed(tag: &str) -> Bed {
    let bed = Bed::new(tag);
    let out = bed.out_ns.clone();
    let pod = format!("{POD_IP}/32");
    let mac = POD_MAC
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    ip(&[
        "-n",
        &out,
        "addr",
        "add",
        &format!("{NODE_IP}/32"),
        "dev",
        "peer0",
    ]);
    ip(&[
        "-n",
        &out,
        "route",
        "add",
        &pod,
        "dev",
        "peer0",
        "src",
        &NODE_IP.to_string(),
    ]);
    ip(&[
        "-n",
        &out,
        "neigh",
        "add",
        &POD_IP.to_string(),
        "lladdr",
        &mac,
        "dev",
        "peer0",
        "nud",
        "permanent",
    ]);
    bed
}

/// Runs `work` on a new thread inside the namespace file `netns`.
fn spawn_in_ns<T: Send + 'static>(
    netns: PathBuf,
    work: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    std::thread::spawn(move || {
        let file = std::fs::File::open(&netns).expect("open netns");
        setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
        work()
    })
}

/// The 16-bit one's complement sum of `data`, folded.
fn sum16(data: &[u8], mut sum: u32) -> u32 {
    for chunk in data.chunks(2) {
        let hi = u32::from(chunk[0]) << 8;
        sum += hi | chunk.get(1).map_or(0, |&lo| u32::from(lo));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

/// A TCP segment from the guest (checksum over the pseudo-header included).
fn tcp(
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut t = Vec::with_capacity(20 + payload.len());
    t.extend_from_slice(&sport.to_be_bytes());
    t.extend_from_slice(&dport.to_be_bytes());
    t.extend_from_slice(&seq.to_be_bytes());
    t.extend_from_slice(&ack.to_be_bytes());
    t.extend_from_slice(&[5 << 4, flags, 0xff, 0xff, 0, 0, 0, 0]);
    t.extend_from_slice(payload);
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend_from_slice(&POD_IP.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&[0, 6]);
    pseudo.extend_from_slice(&(t.len() as u16).to_be_bytes());
    let sum = !(sum16(&t, sum16(&pseudo, 0)) as u16);
    t[16..18].copy_from_slice(&sum.to_be_bytes());
    ether(PEER_MAC, POD_MAC, 0x0800, &ipv4(POD_IP, dst, 6, 0, &t))
}

/// A TCP segment from `src` (outside) to the pod; no checksum (only the
/// programs and the test read it).
fn peer_tcp(src: Ipv4Addr, sport: u16, dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut t = Vec::with_capacity(20 + payload.len());
    t.extend_from_slice(&sport.to_be_bytes());
    t.extend_from_slice(&dport.to_be_bytes());
    t.extend_from_slice(&7u32.to_be_bytes());
    t.extend_from_slice(&7u32.to_be_bytes());
    t.extend_from_slice(&[5 << 4, flags, 0xff, 0xff, 0, 0, 0, 0]);
    t.extend_from_slice(payload);
    ether(POD_MAC, PEER_MAC, 0x0800, &ipv4(src, POD_IP, 6, 0, &t))
}

/// A UDP datagram from `src:sport` (outside) to the pod's `dport`.
fn peer_udp(src: Ipv4Addr, sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    ether(
        POD_MAC,
        PEER_MAC,
        0x0800,
        &ipv4(src, POD_IP, 17, 0, &l4(sport, dport, payload)),
    )
}

/// Sends `frame` from outside and waits until the guest has it (so the
/// veth's program has seen it).
fn peer_sends(bed: &mut Bed, frame: &[u8], marker: &[u8]) {
    bed.outside_send(frame);
    bed.guest_recv_until(|f| contains(f, marker));
}

/// An ICMP echo message (`kind` 8 request, 0 reply), checksum included.
fn icmp_echo(kind: u8, id: u16, seq: u16, payload: &[u8]) -> Vec<u8> {
    let mut m = vec![kind, 0, 0, 0];
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&seq.to_be_bytes());
    m.extend_from_slice(payload);
    let sum = !(sum16(&m, 0) as u16);
    m[2..4].copy_from_slice(&sum.to_be_bytes());
    m
}

/// A UDP datagram from the guest's `sport` to `dst:dport`.
fn guest_udp_from(sport: u16, dst: Ipv4Addr, dport: u16, payload: &[u8]) -> Vec<u8> {
    ether(
        PEER_MAC,
        POD_MAC,
        0x0800,
        &ipv4(POD_IP, dst, 17, 0, &l4(sport, dport, payload)),
    )
}

/// The IPv4 protocol and transport bytes of a frame the guest received.
fn transport(frame: &[u8]) -> Option<(u8, &[u8])> {
    if frame.len() < 34 || frame[12..14] != [0x08, 0x00] {
        return None;
    }
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    Some((frame[23], frame.get(14 + ihl..)?))
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// The pod's counter of `reason`.
fn count(pod: &PodNetwork, reason: Reason) -> u64 {
    pod.counters().expect("counters").get(reason).packets
}

/// A real TCP client connects from the node; the guest answers the
/// handshake and sends data. Returns the client's port.
fn tcp_exchange(bed: &mut Bed) -> u16 {
    let client = spawn_in_ns(bed.out_netns(), || {
        let to = SocketAddr::from((POD_IP, TCP_PORT));
        let mut stream = TcpStream::connect_timeout(&to, DEADLINE).expect("connect to the pod");
        stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
        stream.write_all(b"tcp-hello").expect("send");
        let mut answer = [0u8; 10];
        stream.read_exact(&mut answer).expect("the guest's answer");
        answer
    });
    let syn = bed.guest_recv_until(|f| {
        transport(f).is_some_and(|(p, t)| p == 6 && be16(&t[2..]) == TCP_PORT && t[13] == TCP_SYN)
    });
    let (_, t) = transport(&syn).expect("tcp");
    let (client_port, client_seq) = (be16(t), be32(&t[4..]));
    bed.guest_send(&tcp(
        NODE_IP,
        TCP_PORT,
        client_port,
        1000,
        client_seq.wrapping_add(1),
        TCP_SYN | TCP_ACK,
        b"",
    ));
    let hello = bed.guest_recv_until(|f| contains(f, b"tcp-hello"));
    let (_, t) = transport(&hello).expect("tcp");
    let acked = be32(&t[4..]).wrapping_add(b"tcp-hello".len() as u32);
    bed.guest_send(&tcp(
        NODE_IP,
        TCP_PORT,
        client_port,
        1001,
        acked,
        TCP_PSH | TCP_ACK,
        b"tcp-answer",
    ));
    let answer = client.join().expect("tcp client");
    assert_eq!(&answer, b"tcp-answer");
    client_port
}

/// A UDP client on the node sends a request; the guest answers it. Returns
/// the client's socket (still bound, for more exchanges) and port.
fn udp_request(
    bed: &mut Bed,
    socket: Option<UdpSocket>,
    payload: &'static [u8],
) -> (UdpSocket, u16) {
    let socket = socket.unwrap_or_else(|| {
        spawn_in_ns(bed.out_netns(), || {
            let s = UdpSocket::bind((NODE_IP, 0)).expect("bind on the node's address");
            s.set_read_timeout(Some(DEADLINE)).expect("timeout");
            s
        })
        .join()
        .expect("udp socket")
    });
    socket
        .send_to(payload, (POD_IP, UDP_PORT))
        .expect("send to the pod");
    let port = socket.local_addr().expect("addr").port();
    bed.guest_recv_until(|f| contains(f, payload));
    (socket, port)
}

/// Receives on the client until `want` arrives (other datagrams skipped).
fn udp_answer(socket: &UdpSocket, want: &[u8]) {
    let mut buf = [0u8; 2048];
    loop {
        let (n, from) = socket.recv_from(&mut buf).expect("the guest's answer");
        if &buf[..n] == want {
            assert_eq!(from, SocketAddr::from((POD_IP, UDP_PORT)));
            return;
        }
    }
}

/// A raw ICMP socket on the node pings the pod; the guest answers.
fn ping_exchange(bed: &mut Bed) -> u16 {
    const ID: u16 = 0x7e57;
    let client = spawn_in_ns(bed.out_netns(), || {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP) };
        assert!(
            fd >= 0,
            "raw ICMP socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let request = icmp_echo(8, ID, 1, b"ping-hello");
        let to = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(POD_IP.octets()),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: `request` is a valid buffer; `to` is a valid `sockaddr_in`
        // and the length passed is its size.
        let n = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                request.as_ptr().cast(),
                request.len(),
                0,
                (&to as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as u32,
            )
        };
        assert_eq!(
            n,
            request.len() as isize,
            "sendto: {}",
            std::io::Error::last_os_error()
        );
        let deadline = Instant::now() + DEADLINE;
        let mut buf = [0u8; 2048];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no echo reply reached the node in time");
            let mut pfd = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid `pollfd`, count 1.
            unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) };
            // SAFETY: `buf` is a valid writable buffer of `buf.len()` bytes.
            let n = unsafe {
                libc::recv(
                    fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n < 20 {
                continue;
            }
            // A raw socket gets the IPv4 header too.
            let packet = &buf[..n as usize];
            let icmp = &packet[usize::from(packet[0] & 0x0f) * 4..];
            if icmp.len() >= 8 && icmp[0] == 0 && be16(&icmp[4..]) == ID {
                return icmp.to_vec();
            }
        }
    });
    let request = bed.guest_recv_until(|f| {
        transport(f)
            .is_some_and(|(p, t)| p == 1 && t.first() == Some(&8) && contains(t, b"ping-hello"))
    });
    let (_, t) = transport(&request).expect("icmp");
    let reply = icmp_echo(0, be16(&t[4..]), be16(&t[6..]), &t[8..]);
    bed.guest_send(&ether(
        PEER_MAC,
        POD_MAC,
        0x0800,
        &ipv4(POD_IP, NODE_IP, 1, 0, &reply),
    ));
    let got = client.join().expect("ping client");
    assert_eq!(got, reply, "the node gets the guest's echo reply");
    ID
}

fn the_nodes_tcp_udp_and_ping_are_answered(mode: AttachMode) {
    let tag = match mode {
        AttachMode::Tcx => "rx",
        AttachMode::Netlink => "rn",
    };
    let mut bed = node_bed(tag);
    let (mut pod, _) = loader(mode)
        .attach(
            &bed.bpffs.pod_dir("r"),
            &bed.config(),
            &EgressPolicy::default(),
            &node(),
        )
        .expect("attach");
    assert_eq!(
        pod.flow_timeouts().expect("timeouts"),
        FlowTimeouts::default()
    );
    assert_eq!(pod.udp_reply_ports().expect("ports"), []);
    pod.set_udp_reply_ports(&[port(UDP_PORT)])
        .expect("opt in to UDP replies");

    let tcp_client = tcp_exchange(&mut bed);
    wait_count(&pod, Reason::PassReply, 2);
    let (udp, udp_client) = udp_request(&mut bed, None, b"udp-hello");
    bed.guest_send(&guest_udp_from(
        UDP_PORT,
        NODE_IP,
        udp_client,
        b"udp-answer",
    ));
    udp_answer(&udp, b"udp-answer");
    wait_count(&pod, Reason::PassReply, 3);
    let echo_id = ping_exchange(&mut bed);
    wait_count(&pod, Reason::PassReply, 4);
    assert_eq!(count(&pod, Reason::Private), 0);

    // The guest cannot start anything towards the node: a new connection,
    // a SYN on the very port pair the node used, a datagram to a port pair
    // that never came in (either side), an echo request with the node's
    // identifier.
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "new-connection",
            tcp(NODE_IP, 40001, 9000, 1, 0, TCP_SYN, b"new-connection"),
        ),
        (
            "syn-on-flow",
            tcp(NODE_IP, TCP_PORT, tcp_client, 1, 0, TCP_SYN, b"syn-on-flow"),
        ),
        (
            "other-node-port",
            guest_udp_from(
                UDP_PORT,
                NODE_IP,
                udp_client.wrapping_add(1),
                b"other-node-port",
            ),
        ),
        (
            "other-pod-port",
            guest_udp_from(UDP_PORT + 1, NODE_IP, udp_client, b"other-pod-port"),
        ),
        (
            "tcp-as-udp",
            guest_udp_from(TCP_PORT, NODE_IP, tcp_client, b"tcp-as-udp"),
        ),
        (
            "echo-request",
            ether(
                PEER_MAC,
                POD_MAC,
                0x0800,
                &ipv4(
                    POD_IP,
                    NODE_IP,
                    1,
                    0,
                    &icmp_echo(8, echo_id, 9, b"echo-request"),
                ),
            ),
        ),
    ];
    for (name, frame) in &cases {
        assert_dropped(&mut bed, &pod, name, frame, Reason::Private);
    }
    // The answer on the recorded flows still passes, and is not counted as
    // a drop.
    bed.guest_send(&guest_udp_from(UDP_PORT, NODE_IP, udp_client, b"udp-again"));
    udp_answer(&udp, b"udp-again");
    let counters = pod.counters().expect("counters");
    assert_eq!(counters.get(Reason::PassReply).packets, 5, "{counters:?}");
    assert_eq!(
        counters.dropped_packets(),
        cases.len() as u64,
        "{counters:?}"
    );
    pod.detach().expect("detach");
}

#[test]
fn a_reply_after_the_idle_timeout_is_dropped() {
    let mut bed = node_bed("rto");
    let (mut pod, _) = loader(AttachMode::Netlink)
        .attach(
            &bed.bpffs.pod_dir("r"),
            &bed.config(),
            &EgressPolicy::default(),
            &node(),
        )
        .expect("attach");
    pod.set_udp_reply_ports(&[port(UDP_PORT)])
        .expect("opt in to UDP replies");
    let (udp, client) = udp_request(&mut bed, None, b"udp-hello");
    // The guest has read the node's datagram: the flow was last seen before.
    let seen_before = Instant::now();
    bed.guest_send(&guest_udp_from(UDP_PORT, NODE_IP, client, b"in-time"));
    udp_answer(&udp, b"in-time");

    // Once `seen_before + short` has passed on the same clock as the
    // program's (`CLOCK_MONOTONIC`), the flow is idle for longer than that.
    let short = Duration::from_millis(50);
    let timeouts = FlowTimeouts {
        udp: short,
        ..FlowTimeouts::default()
    };
    pod.set_flow_timeouts(&timeouts).expect("set timeouts");
    assert_eq!(pod.flow_timeouts().expect("timeouts"), timeouts);
    while seen_before.elapsed() <= short {
        std::thread::yield_now();
    }
    assert_dropped(
        &mut bed,
        &pod,
        "too-late",
        &guest_udp_from(UDP_PORT, NODE_IP, client, b"too-late"),
        Reason::Private,
    );

    // A new datagram from the node refreshes the flow.
    let (udp, _) = udp_request(&mut bed, Some(udp), b"udp-again");
    bed.guest_send(&guest_udp_from(UDP_PORT, NODE_IP, client, b"refreshed"));
    udp_answer(&udp, b"refreshed");

    // A zero timeout turns UDP replies off; TCP and ICMP keep theirs.
    pod.set_flow_timeouts(&FlowTimeouts {
        udp: Duration::ZERO,
        ..FlowTimeouts::default()
    })
    .expect("set timeouts");
    assert_dropped(
        &mut bed,
        &pod,
        "udp-off",
        &guest_udp_from(UDP_PORT, NODE_IP, client, b"udp-off"),
        Reason::Private,
    );
    // A timeout too long for the config map is refused and changes nothing.
    let err = pod
        .set_flow_timeouts(&FlowTimeouts {
            tcp: Duration::from_secs(60 * 24 * 60 * 60),
            ..FlowTimeouts::default()
        })
        .expect_err("too long");
    assert!(err.to_string().contains("tcp flow idle timeout"), "{err}");
    assert_eq!(pod.flow_timeouts().expect("timeouts").udp, Duration::ZERO);
    assert_eq!(count(&pod, Reason::PassReply), 2);
    pod.detach().expect("detach");
}

#[test]
fn a_deny_rule_drops_replies_too_and_a_default_deny_does_not() {
    let mut bed = node_bed("rdn");
    let policy = EgressPolicy {
        default_action: twig_net::Action::Deny,
        allow: vec![EgressRule::cidr(&format!("{PEER_IP}/32"))],
        deny: vec![EgressRule::cidr(&format!("{NODE_IP}/32"))],
        udp_reply_ports: vec![],
    };
    let (mut pod, _) = loader(AttachMode::Netlink)
        .attach(&bed.bpffs.pod_dir("r"), &bed.config(), &policy, &node())
        .expect("attach");
    pod.set_udp_reply_ports(&[port(UDP_PORT)])
        .expect("opt in to UDP replies");
    let (_udp, client) = udp_request(&mut bed, None, b"udp-hello");
    assert_dropped(
        &mut bed,
        &pod,
        "denied-reply",
        &guest_udp_from(UDP_PORT, NODE_IP, client, b"denied-reply"),
        Reason::DenyRule,
    );
    // A public peer the default action denies is answered.
    let public = Ipv4Addr::new(203, 0, 113, 5);
    bed.outside_send(&ether(
        POD_MAC,
        PEER_MAC,
        0x0800,
        &ipv4(public, POD_IP, 17, 0, &l4(5353, UDP_PORT, b"public-hello")),
    ));
    bed.guest_recv_until(|f| contains(f, b"public-hello"));
    assert_passes(
        &mut bed,
        &guest_udp_from(UDP_PORT, public, 5353, b"public-answer"),
        "public-answer",
    );
    assert_dropped(
        &mut bed,
        &pod,
        "public-other-port",
        &guest_udp_from(UDP_PORT, public, 5354, b"public-other-port"),
        Reason::Default,
    );
    assert_eq!(count(&pod, Reason::PassReply), 1);
    pod.detach().expect("detach");
}

#[test]
fn flows_survive_a_restart_and_a_new_attach_starts_empty() {
    let mut bed = node_bed("rrs");
    let dir = bed.bpffs.pod_dir("r");
    let loader = loader(AttachMode::Netlink);
    let (mut pod, _) = loader
        .attach(&dir, &bed.config(), &EgressPolicy::default(), &node())
        .expect("attach");
    pod.set_udp_reply_ports(&[port(UDP_PORT)])
        .expect("opt in to UDP replies");
    let flows = aya::maps::MapData::from_pin(dir.join("flows")).expect("the flow map is pinned");
    let info = flows.info().expect("map info");
    assert_eq!(
        info.max_entries() as usize,
        twig_net::FLOW_CAPACITY,
        "FLOW_CAPACITY is the map's size"
    );
    drop(flows);
    let (udp, client) = udp_request(&mut bed, None, b"udp-hello");
    // The handle goes away (a shim restart); recorded flows stay.
    drop(pod);
    let pod = PodNetwork::open(&dir).expect("reopen");
    assert_eq!(pod.udp_reply_ports().expect("ports"), [port(UDP_PORT)]);
    bed.guest_send(&guest_udp_from(UDP_PORT, NODE_IP, client, b"after-restart"));
    udp_answer(&udp, b"after-restart");
    wait_count(&pod, Reason::PassReply, 1);
    pod.detach().expect("detach");

    // A clone's path is a new attach: it knows no flow of its source's.
    let (clone, _) = loader
        .attach(
            &bed.bpffs.pod_dir("clone"),
            &bed.config(),
            &EgressPolicy::default(),
            &node(),
        )
        .expect("attach the clone");
    assert_eq!(clone.udp_reply_ports().expect("ports"), []);
    assert_dropped(
        &mut bed,
        &clone,
        "source-flow",
        &guest_udp_from(UDP_PORT, NODE_IP, client, b"source-flow"),
        Reason::Private,
    );
    assert_eq!(count(&clone, Reason::PassReply), 0);
    clone.detach().expect("detach");
}

#[test]
fn only_a_syn_opens_a_tcp_reply_path() {
    let mut bed = node_bed("rsyn");
    let (mut pod, _) = loader(AttachMode::Netlink)
        .attach(
            &bed.bpffs.pod_dir("r"),
            &bed.config(),
            &deny_by_default(),
            &node(),
        )
        .expect("attach");

    // Segments of no connection the forbidden peer opened (an ACK, data, a
    // SYN-ACK as if the guest had called) open nothing: the guest's answers
    // to them are dropped.
    let stray: [(&str, u16, u8); 3] = [
        ("ack-only", 41000, TCP_ACK),
        ("data-only", 41001, TCP_PSH | TCP_ACK),
        ("syn-ack-in", 41002, TCP_SYN | TCP_ACK),
    ];
    for (name, peer_port, flags) in stray {
        peer_sends(
            &mut bed,
            &peer_tcp(FORBIDDEN_IP, peer_port, TCP_PORT, flags, name.as_bytes()),
            name.as_bytes(),
        );
        for (answer, flags) in [("ack", TCP_ACK), ("data", TCP_PSH | TCP_ACK)] {
            let name = format!("{answer}-to-{name}");
            assert_dropped(
                &mut bed,
                &pod,
                &name,
                &tcp(
                    FORBIDDEN_IP,
                    TCP_PORT,
                    peer_port,
                    1,
                    8,
                    flags,
                    name.as_bytes(),
                ),
                Reason::Default,
            );
        }
    }
    assert_eq!(count(&pod, Reason::PassReply), 0);

    // A SYN (a connection the peer opens) lets the guest's SYN-ACK and data
    // through, on that port pair only.
    const CLIENT: u16 = 41003;
    peer_sends(
        &mut bed,
        &peer_tcp(FORBIDDEN_IP, CLIENT, TCP_PORT, TCP_SYN, b"syn-open"),
        b"syn-open",
    );
    let seen_before = Instant::now();
    assert_passes(
        &mut bed,
        &tcp(
            FORBIDDEN_IP,
            TCP_PORT,
            CLIENT,
            1000,
            8,
            TCP_SYN | TCP_ACK,
            b"syn-ack-answer",
        ),
        "syn-ack-answer",
    );
    assert_passes(
        &mut bed,
        &tcp(
            FORBIDDEN_IP,
            TCP_PORT,
            CLIENT,
            1001,
            8,
            TCP_PSH | TCP_ACK,
            b"data-answer",
        ),
        "data-answer",
    );
    wait_count(&pod, Reason::PassReply, 2);
    assert_dropped(
        &mut bed,
        &pod,
        "other-pair",
        &tcp(
            FORBIDDEN_IP,
            TCP_PORT,
            CLIENT + 1,
            1001,
            8,
            TCP_PSH | TCP_ACK,
            b"other-pair",
        ),
        Reason::Default,
    );

    // Once the connection has idled past the TCP timeout, a later segment
    // of it does not revive it; a new SYN does.
    let short = Duration::from_millis(50);
    pod.set_flow_timeouts(&FlowTimeouts {
        tcp: short,
        ..FlowTimeouts::default()
    })
    .expect("set timeouts");
    while seen_before.elapsed() <= short {
        std::thread::yield_now();
    }
    peer_sends(
        &mut bed,
        &peer_tcp(FORBIDDEN_IP, CLIENT, TCP_PORT, TCP_ACK, b"late-ack"),
        b"late-ack",
    );
    assert_dropped(
        &mut bed,
        &pod,
        "after-expiry",
        &tcp(
            FORBIDDEN_IP,
            TCP_PORT,
            CLIENT,
            1002,
            8,
            TCP_PSH | TCP_ACK,
            b"after-expiry",
        ),
        Reason::Default,
    );
    peer_sends(
        &mut bed,
        &peer_tcp(FORBIDDEN_IP, CLIENT, TCP_PORT, TCP_SYN, b"syn-again"),
        b"syn-again",
    );
    assert_passes(
        &mut bed,
        &tcp(
            FORBIDDEN_IP,
            TCP_PORT,
            CLIENT,
            1003,
            8,
            TCP_PSH | TCP_ACK,
            b"reopened",
        ),
        "reopened",
    );
    wait_count(&pod, Reason::PassReply, 3);
    pod.detach().expect("detach");
}

#[test]
fn udp_opens_a_reply_path_only_to_a_port_the_pod_opted_in() {
    let mut bed = node_bed("rudp");
    let (mut pod, _) = loader(AttachMode::Netlink)
        .attach(
            &bed.bpffs.pod_dir("r"),
            &bed.config(),
            &deny_by_default(),
            &node(),
        )
        .expect("attach");
    assert_eq!(pod.udp_reply_ports().expect("ports"), []);
    const PEER_PORT: u16 = 5353;
    let answer =
        |from: u16, name: &str| guest_udp_from(from, FORBIDDEN_IP, PEER_PORT, name.as_bytes());

    // By default, a datagram from the forbidden peer opens nothing.
    peer_sends(
        &mut bed,
        &peer_udp(FORBIDDEN_IP, PEER_PORT, UDP_PORT, b"udp-stray"),
        b"udp-stray",
    );
    assert_dropped(
        &mut bed,
        &pod,
        "stray-answer",
        &answer(UDP_PORT, "stray-answer"),
        Reason::Default,
    );
    // Nor was it recorded for later: opting in afterwards answers nothing.
    pod.set_udp_reply_ports(&[port(UDP_PORT)])
        .expect("opt in to UDP replies");
    assert_eq!(pod.udp_reply_ports().expect("ports"), [port(UDP_PORT)]);
    assert_dropped(
        &mut bed,
        &pod,
        "late-opt-in",
        &answer(UDP_PORT, "late-opt-in"),
        Reason::Default,
    );

    // Opted in, a datagram to that port is answered; one to another port
    // of the pod is not.
    peer_sends(
        &mut bed,
        &peer_udp(FORBIDDEN_IP, PEER_PORT, UDP_PORT, b"udp-opted"),
        b"udp-opted",
    );
    peer_sends(
        &mut bed,
        &peer_udp(FORBIDDEN_IP, PEER_PORT, UDP_PORT + 1, b"udp-other"),
        b"udp-other",
    );
    assert_passes(&mut bed, &answer(UDP_PORT, "opted-answer"), "opted-answer");
    wait_count(&pod, Reason::PassReply, 1);
    assert_dropped(
        &mut bed,
        &pod,
        "other-answer",
        &answer(UDP_PORT + 1, "other-answer"),
        Reason::Default,
    );

    // A rejected list changes nothing; an empty one ends UDP replies at
    // once, for flows already recorded too.
    let err = pod
        .set_udp_reply_ports(&[port(53); 9])
        .expect_err("too many ranges");
    assert!(err.to_string().contains("at most 8"), "{err}");
    assert_eq!(pod.udp_reply_ports().expect("ports"), [port(UDP_PORT)]);
    pod.set_udp_reply_ports(&[]).expect("opt out");
    assert_dropped(
        &mut bed,
        &pod,
        "opted-out",
        &answer(UDP_PORT, "opted-out"),
        Reason::Default,
    );
    assert_eq!(count(&pod, Reason::PassReply), 1);
    pod.detach().expect("detach");
}

/// The policy's `udpReplyPorts` opt the pod in at the attach (a start, a
/// restore, a clone), and a policy update replaces them with the new
/// policy's, as `set_udp_reply_ports` would.
#[test]
fn the_policys_udp_reply_ports_are_applied_at_attach_and_update() {
    let mut bed = node_bed("rpol");
    let serving = EgressPolicy {
        udp_reply_ports: vec![port(UDP_PORT)],
        ..deny_by_default()
    };
    let (mut pod, _) = loader(AttachMode::Netlink)
        .attach(&bed.bpffs.pod_dir("r"), &bed.config(), &serving, &node())
        .expect("attach");
    assert_eq!(pod.udp_reply_ports().expect("ports"), [port(UDP_PORT)]);
    const PEER_PORT: u16 = 5353;
    let answer = |name: &str| guest_udp_from(UDP_PORT, FORBIDDEN_IP, PEER_PORT, name.as_bytes());
    // The peer sends to the pod's port; the pod's answer passes, counted.
    let answered = |bed: &mut _, pod: &_, tag: &str, replies: u64| {
        let asked = format!("udp-{tag}");
        peer_sends(
            bed,
            &peer_udp(FORBIDDEN_IP, PEER_PORT, UDP_PORT, asked.as_bytes()),
            asked.as_bytes(),
        );
        let reply = format!("{tag}-answer");
        assert_passes(bed, &answer(&reply), &reply);
        wait_count(pod, Reason::PassReply, replies);
    };
    answered(&mut bed, &pod, "attach", 1);

    // A policy without them closes UDP replies at once.
    pod.update_policy(&deny_by_default(), &node())
        .expect("update");
    assert_eq!(pod.udp_reply_ports().expect("ports"), []);
    assert_dropped(
        &mut bed,
        &pod,
        "closed-answer",
        &answer("closed-answer"),
        Reason::Default,
    );
    // A rejected policy changes nothing.
    let bad = EgressPolicy {
        udp_reply_ports: vec![port(0)],
        ..deny_by_default()
    };
    let err = pod.update_policy(&bad, &node()).expect_err("port 0");
    assert!(err.to_string().contains("udpReplyPorts[0].port"), "{err}");
    assert_eq!(pod.udp_reply_ports().expect("ports"), []);
    // One with them opens them again.
    pod.update_policy(&serving, &node()).expect("update");
    assert_eq!(pod.udp_reply_ports().expect("ports"), [port(UDP_PORT)]);
    answered(&mut bed, &pod, "reopened", 2);
    pod.detach().expect("detach");
}

mod tcx {
    #[test]
    fn the_nodes_tcp_udp_and_ping_are_answered() {
        super::the_nodes_tcp_udp_and_ping_are_answered(twig_net::AttachMode::Tcx)
    }
}

mod netlink {
    #[test]
    fn the_nodes_tcp_udp_and_ping_are_answered() {
        super::the_nodes_tcp_udp_and_ping_are_answered(twig_net::AttachMode::Netlink)
    }
}
