//! The pod network path on the host: real namespaces, veth, tap and tc
//! programs, in both attach modes (TCX links and netlink tc filters). Every
//! escape from the guest side is dropped and counted; allowed traffic passes
//! both ways. Needs root.

mod common;

use std::net::Ipv4Addr;

use common::*;
use twig_net::{
    Action, AttachMode, EgressPolicy, EgressRule, Error, Loader, NodeContext, PodNetwork,
    PortRange, Protocol, Reason,
};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const CLUSTER_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const DENIED_POD: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 3);

fn node() -> NodeContext {
    NodeContext {
        node_addrs: vec![NODE_IP],
        cluster_dns: vec![CLUSTER_DNS],
    }
}

fn policy() -> EgressPolicy {
    EgressPolicy {
        default_action: Action::Allow,
        allow: vec![],
        deny: vec![
            EgressRule::cidr(&format!("{DENIED_POD}/32")),
            EgressRule {
                cidr: "203.0.113.0/24".into(),
                protocol: Some(Protocol::Tcp),
                ports: vec![PortRange {
                    port: 22,
                    end_port: None,
                }],
            },
        ],
        udp_reply_ports: vec![],
    }
}

fn loader(mode: AttachMode) -> Loader {
    Loader::with_mode(mode).expect("this kernel runs twig-net in this mode")
}

/// How many programs are attached to the ingress of `iface` in `netns`, as
/// the kernel reports them for `mode` (TCX query, or `tc filter show`).
fn attached(mode: AttachMode, netns: &std::path::Path, iface: &'static str) -> usize {
    match mode {
        AttachMode::Tcx => in_ns(netns, move || {
            aya::programs::SchedClassifier::query_tcx(iface, aya::programs::TcAttachType::Ingress)
                .expect("query tcx")
                .1
                .len()
        }),
        AttachMode::Netlink => tc_filters(netns, iface)
            .iter()
            .filter(|line| line.contains(" bpf ") && line.contains("direct-action"))
            .count(),
    }
}

fn every_escape_from_the_guest_is_dropped_and_counted(mode: AttachMode) {
    let tag = format!("esc{}", mode_tag(mode));
    let mut bed = Bed::new(&tag);
    let (pod, mac) = loader(mode)
        .attach(&bed.bpffs.pod_dir("esc"), &bed.config(), &policy(), &node())
        .expect("attach");
    assert_eq!(pod.mode().expect("mode"), mode);
    assert_eq!(mac, POD_MAC, "the guest gets the veth's MAC");

    let cases: Vec<(&str, Vec<u8>, Reason)> = vec![
        (
            "metadata",
            guest_udp(Ipv4Addr::new(169, 254, 169, 254), 80, b"metadata"),
            Reason::DenyRule,
        ),
        (
            "node-ip",
            guest_udp(NODE_IP, 10250, b"node-ip"),
            Reason::Private,
        ),
        (
            "denied-pod",
            guest_udp(DENIED_POD, 8080, b"denied-pod"),
            Reason::DenyRule,
        ),
        (
            "private-pod",
            guest_udp(Ipv4Addr::new(10, 1, 2, 3), 8080, b"private-pod"),
            Reason::Private,
        ),
        (
            "ssh-port",
            ether(
                PEER_MAC,
                POD_MAC,
                0x0800,
                &ipv4(
                    POD_IP,
                    Ipv4Addr::new(203, 0, 113, 9),
                    6,
                    0,
                    &l4(1, 22, b"ssh-port"),
                ),
            ),
            Reason::DenyRule,
        ),
        (
            "spoofed-ip",
            ether(
                PEER_MAC,
                POD_MAC,
                0x0800,
                &ipv4(
                    Ipv4Addr::new(198, 51, 100, 99),
                    PEER_IP,
                    17,
                    0,
                    &l4(1, 9999, b"spoofed-ip"),
                ),
            ),
            Reason::SpoofedIp,
        ),
        (
            "spoofed-mac",
            ether(
                PEER_MAC,
                [2, 0, 0, 0, 0, 0x99],
                0x0800,
                &ipv4(POD_IP, PEER_IP, 17, 0, &l4(1, 9999, b"spoofed-mac")),
            ),
            Reason::SpoofedMac,
        ),
        (
            "ipv6",
            ether(
                PEER_MAC,
                POD_MAC,
                0x86dd,
                b"\x60\0\0\0\0\x08\x11\x40ipv6-frame-ipv6",
            ),
            Reason::Ipv6,
        ),
        (
            "first-fragment",
            ether(
                PEER_MAC,
                POD_MAC,
                0x0800,
                &ipv4(POD_IP, PEER_IP, 17, 0x2000, &l4(1, 9999, b"first-fragment")),
            ),
            Reason::Fragment,
        ),
        (
            "later-fragment",
            ether(
                PEER_MAC,
                POD_MAC,
                0x0800,
                &ipv4(
                    POD_IP,
                    Ipv4Addr::new(169, 254, 169, 254),
                    17,
                    0x0003,
                    b"later-fragment",
                ),
            ),
            Reason::Fragment,
        ),
        (
            "vlan",
            ether(PEER_MAC, POD_MAC, 0x8100, b"\0\x05\x08\0vlan-frame"),
            Reason::Ethertype,
        ),
        (
            "truncated-ip",
            ether(
                PEER_MAC,
                POD_MAC,
                0x0800,
                b"\x45\0\0truncated-ip"[..6].as_ref(),
            ),
            Reason::Malformed,
        ),
    ];
    for (name, frame, reason) in &cases {
        assert_dropped(&mut bed, &pod, name, frame, *reason);
    }

    // ARP speaking for an address or a MAC that is not the pod's.
    let before = pod.counters().expect("counters").get(Reason::Arp).packets;
    bed.guest_send(&arp_request(
        POD_MAC,
        Ipv4Addr::new(198, 51, 100, 77),
        PEER_IP,
    ));
    bed.guest_send(&arp_request([2, 0, 0, 0, 0, 0x77], POD_IP, PEER_IP));
    wait_count(&pod, Reason::Arp, before + 2);

    // Allowed: the pod's own ARP, DNS to the cluster resolver (a private
    // address), a public destination, and UDP to port 22 (only TCP is denied).
    let passed_before = pod
        .counters()
        .expect("counters")
        .get(Reason::PassEgress)
        .packets;
    let own_arp = arp_request(POD_MAC, POD_IP, PEER_IP);
    bed.guest_send(&own_arp);
    bed.outside_recv_until(&own_arp[22..]);
    assert_passes(
        &mut bed,
        &guest_udp(CLUSTER_DNS, 53, b"dns-query"),
        "dns-query",
    );
    assert_passes(
        &mut bed,
        &guest_udp(Ipv4Addr::new(203, 0, 113, 9), 22, b"udp-22"),
        "udp-22",
    );
    assert_passes(
        &mut bed,
        &guest_udp(PEER_IP, 9999, b"public-ok"),
        "public-ok",
    );
    let counters = pod.counters().expect("counters");
    assert!(counters.get(Reason::PassEgress).packets >= passed_before + 4);
    assert_eq!(
        counters.dropped_packets(),
        cases.len() as u64 + 2,
        "{counters:?}"
    );
    assert!(counters.get(Reason::DenyRule).bytes > 0);
    pod.detach().expect("detach");
}

fn frames_from_outside_reach_the_guest(mode: AttachMode) {
    let mut bed = Bed::new(&format!("in{}", mode_tag(mode)));
    let (pod, _) = loader(mode)
        .attach(&bed.bpffs.pod_dir("in"), &bed.config(), &policy(), &node())
        .expect("attach");
    let frame = ether(
        POD_MAC,
        PEER_MAC,
        0x0800,
        &ipv4(PEER_IP, POD_IP, 17, 0, &l4(53, 40000, b"reply-to-guest")),
    );
    bed.outside_send(&frame);
    let got = bed.guest_recv_until(|f| contains(f, b"reply-to-guest"));
    assert_eq!(got, frame, "the guest gets the frame unchanged");
    wait_count(&pod, Reason::PassIngress, 1);
    pod.detach().expect("detach");
}

fn policy_changes_in_place_and_survives_reopening_from_pins(mode: AttachMode) {
    let mut bed = Bed::new(&format!("upd{}", mode_tag(mode)));
    let dir = bed.bpffs.pod_dir("upd");
    let deny_all = EgressPolicy {
        default_action: Action::Deny,
        allow: vec![EgressRule::cidr(&format!("{PEER_IP}/32"))],
        deny: vec![],
        udp_reply_ports: vec![],
    };
    let (pod, _) = loader(mode)
        .attach(&dir, &bed.config(), &deny_all, &node())
        .expect("attach");
    let public = Ipv4Addr::new(203, 0, 113, 7);
    assert_dropped(
        &mut bed,
        &pod,
        "default-deny",
        &guest_udp(public, 443, b"default-deny"),
        Reason::Default,
    );
    // The handle goes away (a shim restart); the path keeps working.
    drop(pod);
    assert_dropped(
        &mut bed,
        &PodNetwork::open(&dir).expect("reopen"),
        "still-deny",
        &guest_udp(public, 443, b"still-deny"),
        Reason::Default,
    );

    let mut pod = PodNetwork::open(&dir).expect("reopen");
    assert_eq!(
        pod.counters()
            .expect("counters")
            .get(Reason::Default)
            .packets,
        2,
        "counters survive"
    );
    assert_eq!(pod.mac().expect("mac"), POD_MAC);

    // A malformed update is rejected and the old policy stays.
    let bad = EgressPolicy {
        deny: vec![EgressRule::cidr("203.0.113.7/16")],
        ..Default::default()
    };
    match pod.update_policy(&bad, &node()) {
        Err(Error::Policy(e)) => assert!(e.to_string().contains("deny[0].cidr"), "{e}"),
        other => panic!("expected a policy error, got {other:?}"),
    }
    assert_dropped(
        &mut bed,
        &pod,
        "after-bad",
        &guest_udp(public, 443, b"after-bad"),
        Reason::Default,
    );

    pod.update_policy(&EgressPolicy::default(), &node())
        .expect("update");
    assert_passes(
        &mut bed,
        &guest_udp(public, 443, b"now-allowed"),
        "now-allowed",
    );
    // Built-in denies hold under the new policy too, and allowing private
    // ranges does not allow the metadata range.
    let open = EgressPolicy {
        allow: vec![
            EgressRule::cidr("10.0.0.0/8"),
            EgressRule::cidr("169.254.169.254"),
        ],
        ..Default::default()
    };
    pod.update_policy(&open, &node()).expect("update");
    assert_passes(
        &mut bed,
        &guest_udp(Ipv4Addr::new(10, 1, 2, 3), 80, b"private-allowed"),
        "private-allowed",
    );
    assert_dropped(
        &mut bed,
        &pod,
        "meta-again",
        &guest_udp(Ipv4Addr::new(169, 254, 169, 254), 80, b"meta-again"),
        Reason::DenyRule,
    );
    pod.detach().expect("detach");
}

fn detach_removes_programs_and_pins(mode: AttachMode) {
    let bed = Bed::new(&format!("det{}", mode_tag(mode)));
    let dir = bed.bpffs.pod_dir("det");
    let netns = bed.pod_netns();
    let loader = loader(mode);
    let (pod, _) = loader
        .attach(&dir, &bed.config(), &policy(), &node())
        .expect("attach");
    assert_eq!(
        (
            attached(mode, &netns, "tap0"),
            attached(mode, &netns, "eth0")
        ),
        (1, 1)
    );
    match loader.attach(&dir, &bed.config(), &policy(), &node()) {
        Err(Error::AlreadyAttached(d)) => assert_eq!(d, dir),
        other => panic!("expected AlreadyAttached, got {other:?}"),
    }
    assert_eq!(
        (
            attached(mode, &netns, "tap0"),
            attached(mode, &netns, "eth0")
        ),
        (1, 1)
    );
    // Detached by a handle re-opened from the pins (as after a restart).
    drop(pod);
    PodNetwork::open(&dir)
        .expect("reopen")
        .detach()
        .expect("detach");
    assert_eq!(
        (
            attached(mode, &netns, "tap0"),
            attached(mode, &netns, "eth0")
        ),
        (0, 0)
    );
    assert!(!dir.exists(), "pins removed");
    match PodNetwork::open(&dir) {
        Err(Error::NotAttached { .. }) => {}
        other => panic!("expected NotAttached, got {other:?}"),
    }
}

fn bad_input_is_refused_and_leaves_nothing(mode: AttachMode) {
    let bed = Bed::new(&format!("bad{}", mode_tag(mode)));
    let loader = loader(mode);
    let dir = bed.bpffs.pod_dir("bad");
    let mut config = bed.config();
    config.tap = "nosuchtap".into();
    match loader.attach(&dir, &config, &policy(), &node()) {
        Err(e @ Error::NoInterface { .. }) => {
            assert!(e.to_string().contains("no interface \"nosuchtap\""), "{e}")
        }
        other => panic!("expected NoInterface, got {other:?}"),
    }
    assert!(!dir.exists());
    let bad = EgressPolicy {
        allow: vec![EgressRule::cidr("fd00::/8")],
        ..Default::default()
    };
    match loader.attach(&dir, &bed.config(), &bad, &node()) {
        Err(Error::Policy(e)) => assert!(e.to_string().contains("IPv6"), "{e}"),
        other => panic!("expected a policy error, got {other:?}"),
    }
    assert!(!dir.exists());
    let mut config = bed.config();
    config.netns = "/run/netns/twig-net-no-such-ns".into();
    assert!(matches!(
        loader.attach(&dir, &config, &policy(), &node()),
        Err(Error::Netns { .. })
    ));
    // A veth without an Ethernet address is refused before anything is attached.
    let mut config = bed.config();
    config.veth = "lo".into();
    match loader.attach(&dir, &config, &policy(), &node()) {
        Err(e @ Error::NoMac(_)) => assert!(e.to_string().contains("\"lo\""), "{e}"),
        other => panic!("expected NoMac, got {other:?}"),
    }
    assert!(!dir.exists());
    let netns = bed.pod_netns();
    assert_eq!(
        (
            attached(mode, &netns, "tap0"),
            attached(mode, &netns, "eth0")
        ),
        (0, 0),
        "nothing attached after failures"
    );
}

/// A set prepared (pinned, unattached) in one directory, moved into the
/// pod's as another process would (a rename within the bpffs), attaches
/// from its pins: the policy holds, a second attach is refused, and a
/// detach leaves nothing. A prepared set never attached is no path, and a
/// directory without one is refused without touching it.
fn prepared_sets_attach_from_their_pins(mode: AttachMode) {
    let mut bed = Bed::new(&format!("prep{}", mode_tag(mode)));
    let netns = bed.pod_netns();
    let staged = bed.bpffs.pod_dir("staged");
    let dir = bed.bpffs.pod_dir("prep");
    loader(mode).prepare(&staged).expect("prepare");
    assert!(
        loader(mode).prepare(&staged).is_err(),
        "a directory that exists is refused"
    );
    match PodNetwork::open(&staged) {
        Err(Error::NotAttached { .. }) => {}
        other => panic!("a prepared set is no attached path: {other:?}"),
    }
    assert_eq!(attached(mode, &netns, "tap0"), 0);
    std::fs::rename(&staged, &dir).expect("move the set into the pod's directory");
    let (pod, mac) = Loader::attach_prepared(&dir, &bed.config(), &policy(), &node(), mode)
        .expect("attach the prepared set");
    assert_eq!(mac, pod.mac().expect("mac"));
    assert!(!dir.join("ready_tap").exists() && !dir.join("ready_veth").exists());
    assert_eq!(
        (
            attached(mode, &netns, "tap0"),
            attached(mode, &netns, "eth0")
        ),
        (1, 1)
    );
    assert_passes(&mut bed, &guest_udp(PEER_IP, 9999, b"prep-ok"), "prep-ok");
    assert_dropped(
        &mut bed,
        &pod,
        "prep-deny",
        &guest_udp(DENIED_POD, 80, b"prep-deny"),
        Reason::DenyRule,
    );
    match Loader::attach_prepared(&dir, &bed.config(), &policy(), &node(), mode) {
        Err(Error::AlreadyAttached(d)) => assert_eq!(d, dir),
        other => panic!("expected AlreadyAttached, got {other:?}"),
    }
    drop(pod);
    PodNetwork::open(&dir)
        .expect("reopen")
        .detach()
        .expect("detach");
    assert!(!dir.exists(), "pins removed");
    assert_eq!(
        (
            attached(mode, &netns, "tap0"),
            attached(mode, &netns, "eth0")
        ),
        (0, 0)
    );
    let empty = bed.bpffs.pod_dir("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    match Loader::attach_prepared(&empty, &bed.config(), &policy(), &node(), mode) {
        Err(e @ Error::NotPrepared { .. }) => {
            assert!(e.to_string().contains("no prepared program set"), "{e}")
        }
        other => panic!("expected NotPrepared, got {other:?}"),
    }
    assert!(empty.exists(), "a refused directory is left as it was");
    // A failed attach of a prepared set spends it: nothing stays pinned.
    let staged = bed.bpffs.pod_dir("staged2");
    loader(mode).prepare(&staged).expect("prepare");
    let mut config = bed.config();
    config.tap = "nosuchtap".into();
    assert!(matches!(
        Loader::attach_prepared(&staged, &config, &policy(), &node(), mode),
        Err(Error::NoInterface { .. })
    ));
    assert!(!staged.exists(), "the failed set's pins are removed");
}

fn mode_tag(mode: AttachMode) -> &'static str {
    match mode {
        AttachMode::Tcx => "x",
        AttachMode::Netlink => "n",
    }
}

/// Every test, in each attach mode.
macro_rules! in_both_modes {
    ($($test:ident),* $(,)?) => {
        mod tcx {
            $(#[test]
            fn $test() {
                super::$test(twig_net::AttachMode::Tcx)
            })*
        }
        mod netlink {
            $(#[test]
            fn $test() {
                super::$test(twig_net::AttachMode::Netlink)
            })*
        }
    };
}

in_both_modes!(
    every_escape_from_the_guest_is_dropped_and_counted,
    frames_from_outside_reach_the_guest,
    policy_changes_in_place_and_survives_reopening_from_pins,
    detach_removes_programs_and_pins,
    bad_input_is_refused_and_leaves_nothing,
    prepared_sets_attach_from_their_pins,
);

#[test]
fn the_default_mode_is_netlink_and_tcx_can_be_asked_for() {
    assert_eq!(
        twig_net::check_support_with(None).expect("supported"),
        AttachMode::Netlink
    );
    assert_eq!(
        twig_net::check_support_with(Some(AttachMode::Tcx)).expect("supported"),
        AttachMode::Tcx
    );
    assert_eq!(loader(AttachMode::Tcx).mode(), AttachMode::Tcx);
}

#[test]
fn attaches_take_preloaded_sets_from_the_pool() {
    let mut bed = Bed::new("pool");
    let loader = loader(AttachMode::Tcx);
    loader.preload(2).expect("preload");
    assert_eq!(loader.pooled(), 2);
    let (pod, _) = loader
        .attach(
            &bed.bpffs.pod_dir("pool"),
            &bed.config(),
            &policy(),
            &node(),
        )
        .expect("attach");
    assert_eq!(loader.pooled(), 1, "the attach used a pooled set");
    assert_passes(
        &mut bed,
        &guest_udp(PEER_IP, 9999, b"pooled-ok"),
        "pooled-ok",
    );
    assert_dropped(
        &mut bed,
        &pod,
        "pooled-deny",
        &guest_udp(DENIED_POD, 80, b"pooled-deny"),
        Reason::DenyRule,
    );
    pod.detach().expect("detach");
    // An empty pool still attaches (loading on the path).
    let (pod, _) = loader
        .attach(
            &bed.bpffs.pod_dir("pool2"),
            &bed.config(),
            &policy(),
            &node(),
        )
        .expect("attach");
    assert_eq!(loader.pooled(), 0);
    assert_passes(
        &mut bed,
        &guest_udp(PEER_IP, 9999, b"unpooled-ok"),
        "unpooled-ok",
    );
    pod.detach().expect("detach");
}

#[test]
fn netlink_detach_after_a_restart_removes_exactly_its_own_filters() {
    let mut bed = Bed::new("own");
    let netns = bed.pod_netns();
    // Someone else's filter on the veth, before and after ours.
    tc(&netns, &["qdisc", "add", "dev", "eth0", "clsact"]);
    // (a classic BPF classifier that never matches: this kernel has
    // neither matchall nor the gact action.)
    tc(
        &netns,
        &[
            "filter",
            "add",
            "dev",
            "eth0",
            "ingress",
            "prio",
            "1",
            "bpf",
            "bytecode",
            "1,6 0 0 0",
        ],
    );
    let dir = bed.bpffs.pod_dir("own");
    let (pod, _) = loader(AttachMode::Netlink)
        .attach(&dir, &bed.config(), &policy(), &node())
        .expect("attach");
    assert_passes(&mut bed, &guest_udp(PEER_IP, 9999, b"own-ok"), "own-ok");
    let foreign = |netns: &std::path::Path| {
        tc_filters(netns, "eth0")
            .iter()
            .filter(|l| l.contains("bytecode"))
            .count()
    };
    assert_eq!(foreign(&netns), 1);
    drop(pod);
    PodNetwork::open(&dir)
        .expect("reopen")
        .detach()
        .expect("detach");
    assert_eq!(
        (
            attached(AttachMode::Netlink, &netns, "tap0"),
            attached(AttachMode::Netlink, &netns, "eth0")
        ),
        (0, 0)
    );
    assert_eq!(foreign(&netns), 1, "the other filter stays");
    assert!(!dir.exists(), "pins removed");
}

#[test]
fn netlink_detach_after_the_namespace_is_gone_removes_the_pins() {
    let bed = Bed::new("gone");
    let dir = bed.bpffs.pod_dir("gone");
    let (pod, _) = loader(AttachMode::Netlink)
        .attach(&dir, &bed.config(), &policy(), &node())
        .expect("attach");
    drop(pod);
    bed.delete_pod_netns();
    PodNetwork::open(&dir)
        .expect("reopen")
        .detach()
        .expect("detach");
    assert!(!dir.exists(), "pins removed");
}

/// `TWIG_NET_ATTACH_MODE` forces the mode, and a bad value is refused. The
/// environment is read in a child run of this test (`EXPECT` says what the
/// child must see), so no other test sees it changed.
#[test]
fn the_environment_forces_the_attach_mode() {
    const EXPECT: &str = "TWIG_NET_TEST_EXPECT_MODE";
    const NAME: &str = "the_environment_forces_the_attach_mode";
    if let Some(expect) = std::env::var_os(EXPECT) {
        match (expect.to_str(), twig_net::check_support()) {
            (Some("netlink"), Ok(AttachMode::Netlink)) | (Some("tcx"), Ok(AttachMode::Tcx)) => {}
            (Some("error"), Err(e)) => {
                assert!(e.to_string().contains("expected `tcx` or `netlink`"), "{e}")
            }
            (expect, got) => panic!("expected {expect:?}, got {got:?}"),
        }
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    for (value, expect) in [("netlink", "netlink"), ("tcx", "tcx"), ("bpf", "error")] {
        let out = std::process::Command::new(&exe)
            .args(["--exact", NAME, "--test-threads", "1"])
            .env(twig_net::ATTACH_MODE_ENV, value)
            .env(EXPECT, expect)
            .output()
            .expect("run the test binary");
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "{value}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
