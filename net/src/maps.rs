//! Rust mirrors of the map keys and values of `bpf/pod.c` (same layout, same
//! constants) and the names the maps and links are pinned under.

#[cfg(feature = "loader")]
use std::net::Ipv4Addr;

#[cfg(feature = "loader")]
/// Name of the program attached to the tap's ingress (frames from the guest).
pub(crate) const PROG_TAP: &str = "tap_ingress";
#[cfg(feature = "loader")]
/// Name of the program attached to the veth's ingress (frames to the guest).
pub(crate) const PROG_VETH: &str = "veth_ingress";

#[cfg(feature = "loader")]
/// Map names, also the names of their pins in the pod's bpffs directory.
pub(crate) const MAP_CONFIG: &str = "config";
#[cfg(feature = "loader")]
pub(crate) const MAP_STATE: &str = "state";
#[cfg(feature = "loader")]
pub(crate) const MAP_RULES: &str = "rules";
#[cfg(feature = "loader")]
pub(crate) const MAP_COUNTERS: &str = "counters";
#[cfg(feature = "loader")]
pub(crate) const MAP_ATTACHMENT: &str = "attachment";
#[cfg(feature = "loader")]
/// The flows peers started towards the pod (LRU hash), for reply tracking.
pub(crate) const MAP_FLOWS: &str = "flows";
#[cfg(feature = "loader")]
/// Pins of the TCX links that keep the programs attached (TCX mode).
pub(crate) const LINK_TAP: &str = "link_tap";
#[cfg(feature = "loader")]
pub(crate) const LINK_VETH: &str = "link_veth";
#[cfg(feature = "loader")]
/// Pins of the programs (netlink mode: the tc filters hold them, the pins let
/// a restarted process find them).
pub(crate) const PIN_PROG_TAP: &str = "prog_tap";
#[cfg(feature = "loader")]
pub(crate) const PIN_PROG_VETH: &str = "prog_veth";
#[cfg(feature = "loader")]
/// Pins of the programs of a prepared set ([`crate::Loader::prepare`]):
/// verified, not attached yet.
pub(crate) const PIN_READY_TAP: &str = "ready_tap";
#[cfg(feature = "loader")]
pub(crate) const PIN_READY_VETH: &str = "ready_veth";
#[cfg(feature = "loader")]
/// Netlink mode: a symlink to the namespace file the filters were added in.
pub(crate) const PIN_NETNS: &str = "netns";
#[cfg(feature = "loader")]
/// The map pins every pod directory holds.
pub(crate) const MAP_PINS: [&str; 6] = [
    MAP_CONFIG,
    MAP_STATE,
    MAP_RULES,
    MAP_COUNTERS,
    MAP_ATTACHMENT,
    MAP_FLOWS,
];
#[cfg(feature = "loader")]
/// Every name a pod directory may hold, in either mode.
pub(crate) const ALL_PINS: [&str; 13] = [
    PIN_READY_TAP,
    PIN_READY_VETH,
    LINK_TAP,
    LINK_VETH,
    PIN_PROG_TAP,
    PIN_PROG_VETH,
    PIN_NETNS,
    MAP_CONFIG,
    MAP_STATE,
    MAP_RULES,
    MAP_COUNTERS,
    MAP_ATTACHMENT,
    MAP_FLOWS,
];

/// Capacity of the `rules` LPM trie (`max_entries` in `bpf/pod.c`), shared
/// by both generations during an update.
pub const RULE_CAPACITY: usize = 65_536;

/// Capacity of the `flows` LRU hash (`max_entries` in `bpf/pod.c`): how many
/// flows peers started towards one pod are remembered for replies; past it
/// the least recently seen is forgotten.
pub const FLOW_CAPACITY: usize = 8_192;

#[cfg(feature = "loader")]
/// Index of the active generation in `state`.
pub(crate) const STATE_ACTIVE_GEN: u32 = 0;
#[cfg(feature = "loader")]
/// Index of the default action of generation `gen` in `state` (0 allow, 1 deny).
pub(crate) fn state_default_index(gen: u8) -> u32 {
    1 + u32::from(gen & 1)
}

/// `UDP_REPLY_RANGES`: how many UDP port ranges a pod may open to replies.
pub(crate) const UDP_REPLY_RANGES: usize = 8;

#[cfg(feature = "loader")]
/// `struct pod_config`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PodConfig {
    pub pod_ip: [u8; 4],
    pub veth_ifindex: u32,
    pub tap_ifindex: u32,
    pub mac: [u8; 6],
    pub pad: u16,
    /// Idle timeouts of recorded flows, in milliseconds (0: no replies).
    pub tcp_idle_ms: u32,
    pub udp_idle_ms: u32,
    pub icmp_idle_ms: u32,
    /// The pod's UDP ports (inclusive ranges, host order) whose datagrams
    /// open a reply path; a range starting at 0 ends the list.
    pub udp_reply_ports: [[u16; 2]; UDP_REPLY_RANGES],
}

#[cfg(feature = "loader")]
// SAFETY: `PodConfig` is `repr(C)`, made only of integers and integer
// arrays, with no implicit padding (4 + 4 + 4 + 6 + 2 + 3 * 4 + 8 * 2 * 2
// bytes, every field at a multiple of its alignment), so every bit pattern is a valid value and it
// can be copied to and from the kernel as bytes.
unsafe impl aya::Pod for PodConfig {}

#[cfg(feature = "loader")]
const _: () = assert!(std::mem::size_of::<PodConfig>() == 64);

/// The tiers of `enum tier`: the order in which rules are checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Tier {
    Deny = 0,
    Allow = 1,
    Private = 2,
}

#[cfg(feature = "loader")]
/// Bits of the `rule_key` data before the destination address.
pub(crate) const KEY_FIXED_BITS: u32 = 64;

#[cfg(feature = "loader")]
/// The data part of `struct rule_key` (aya's `lpm_trie::Key` adds the prefix
/// length in front).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct RuleKey {
    pub gen: u8,
    pub tier: u8,
    pub proto: u8,
    pub zero: u8,
    /// Network byte order.
    pub port: [u8; 2],
    pub zero2: u16,
    /// Network byte order.
    pub addr: [u8; 4],
}

#[cfg(feature = "loader")]
// SAFETY: `RuleKey` is `repr(C)` with only integer and byte-array fields and
// no implicit padding (1 + 1 + 1 + 1 + 2 + 2 + 4 bytes); any bit pattern is
// valid.
unsafe impl aya::Pod for RuleKey {}

#[cfg(feature = "loader")]
impl RuleKey {
    /// A key for generation `gen` of one compiled rule entry.
    pub fn new(gen: u8, tier: Tier, proto: u8, port: u16, addr: Ipv4Addr) -> Self {
        Self {
            gen: gen & 1,
            tier: tier as u8,
            proto,
            zero: 0,
            port: port.to_be_bytes(),
            zero2: 0,
            addr: addr.octets(),
        }
    }
}

#[cfg(feature = "loader")]
/// `struct counter`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RawCounter {
    pub packets: u64,
    pub bytes: u64,
}

#[cfg(feature = "loader")]
// SAFETY: two `u64`s, `repr(C)`, no padding; any bit pattern is valid.
unsafe impl aya::Pod for RawCounter {}

#[cfg(feature = "loader")]
/// `attachment.mode` of a path attached as TCX links.
pub(crate) const MODE_TCX: u32 = 1;
#[cfg(feature = "loader")]
/// `attachment.mode` of a path attached as netlink tc filters.
pub(crate) const MODE_NETLINK: u32 = 2;

#[cfg(feature = "loader")]
/// `struct attachment`: where the programs are attached.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Attachment {
    pub mode: u32,
    pub tap_ifindex: u32,
    pub veth_ifindex: u32,
    pub tap_prio: u16,
    pub veth_prio: u16,
    pub tap_handle: u32,
    pub veth_handle: u32,
    pub netns_dev: u64,
    pub netns_ino: u64,
}

#[cfg(feature = "loader")]
// SAFETY: `repr(C)`, integers only, no implicit padding (3 * 4 + 2 * 2 +
// 2 * 4 = 24 bytes, then two 8-byte-aligned `u64`s); any bit pattern is valid.
unsafe impl aya::Pod for Attachment {}
