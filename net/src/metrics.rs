//! Per-pod counters and their OpenMetrics rendering.

use std::fmt::Write as _;

/// Why a frame was counted: the index of its counter in the `counters` map
/// (`enum reason` in `bpf/pod.c`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Passed from the guest out of the veth.
    PassEgress = 0,
    /// Passed from the veth to the guest.
    PassIngress = 1,
    /// Guest frame with a source MAC that is not the pod's.
    SpoofedMac = 2,
    /// Guest IPv4 packet with a source address that is not the pod's.
    SpoofedIp = 3,
    /// Guest ARP that speaks for an address or MAC not the pod's, or is not
    /// Ethernet/IPv4 ARP.
    Arp = 4,
    /// Guest IPv6 frame.
    Ipv6 = 5,
    /// Guest IPv4 fragment (first or later).
    Fragment = 6,
    /// Destination matched a `deny` rule (or the always-denied link-local range).
    DenyRule = 7,
    /// Destination is private or the node's own and no `allow` rule covers it.
    Private = 8,
    /// No rule matched and the default action is deny.
    Default = 9,
    /// Truncated or malformed headers.
    Malformed = 10,
    /// Ethertype other than IPv4, ARP and IPv6 (VLAN tags included).
    Ethertype = 11,
    /// The pod's configuration map was empty.
    NoConfig = 12,
    /// Passed from the guest out of the veth because it answers a flow the
    /// peer started (see `FlowTimeouts`), where the policy alone (private
    /// ranges or a default deny) would have dropped it.
    PassReply = 13,
}

impl Reason {
    /// Every reason, in counter-index order.
    pub const ALL: [Reason; 14] = [
        Reason::PassEgress,
        Reason::PassIngress,
        Reason::SpoofedMac,
        Reason::SpoofedIp,
        Reason::Arp,
        Reason::Ipv6,
        Reason::Fragment,
        Reason::DenyRule,
        Reason::Private,
        Reason::Default,
        Reason::Malformed,
        Reason::Ethertype,
        Reason::NoConfig,
        Reason::PassReply,
    ];

    /// Whether frames counted here were dropped.
    pub fn is_drop(self) -> bool {
        !matches!(
            self,
            Reason::PassEgress | Reason::PassIngress | Reason::PassReply
        )
    }

    /// The `reason` label of the metric.
    pub fn label(self) -> &'static str {
        match self {
            Reason::PassEgress => "egress",
            Reason::PassIngress => "ingress",
            Reason::SpoofedMac => "spoofed_mac",
            Reason::SpoofedIp => "spoofed_ip",
            Reason::Arp => "arp",
            Reason::Ipv6 => "ipv6",
            Reason::Fragment => "fragment",
            Reason::DenyRule => "deny_rule",
            Reason::Private => "private",
            Reason::Default => "default_deny",
            Reason::Malformed => "malformed",
            Reason::Ethertype => "ethertype",
            Reason::NoConfig => "no_config",
            Reason::PassReply => "reply",
        }
    }
}

/// Packets and bytes of one reason, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    /// Frames.
    pub packets: u64,
    /// Bytes of those frames (Ethernet header included).
    pub bytes: u64,
}

/// A snapshot of one pod's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub(crate) values: [Counter; Reason::ALL.len()],
}

impl Counters {
    /// The counter of `reason`.
    pub fn get(&self, reason: Reason) -> Counter {
        self.values[reason as usize]
    }

    /// Frames dropped for any reason.
    pub fn dropped_packets(&self) -> u64 {
        Reason::ALL
            .iter()
            .filter(|r| r.is_drop())
            .map(|&r| self.get(r).packets)
            .sum()
    }
}

/// One pod's counters with the labels they are exported under.
#[derive(Clone, Debug)]
pub struct PodCounters<'a> {
    /// The pod's Kubernetes namespace.
    pub namespace: &'a str,
    /// The pod's name.
    pub pod: &'a str,
    /// Its counters.
    pub counters: &'a Counters,
}

fn escape(value: &str) -> String {
    value
        .replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// Renders the counters of several pods as one OpenMetrics text exposition
/// (`twig_pod_network_packets_total` and `twig_pod_network_bytes_total`,
/// labelled `namespace`, `pod`, `verdict` and `reason`), ending in `# EOF`.
pub fn render_openmetrics(pods: &[PodCounters<'_>]) -> String {
    let mut out = String::new();
    for (family, help, pick) in [
        (
            "twig_pod_network_packets",
            "Frames through a pod's network path, by verdict and reason.",
            0,
        ),
        (
            "twig_pod_network_bytes",
            "Bytes through a pod's network path, by verdict and reason.",
            1,
        ),
    ] {
        let _ = writeln!(out, "# TYPE {family} counter\n# HELP {family} {help}");
        for pod in pods {
            for reason in Reason::ALL {
                let counter = pod.counters.get(reason);
                let value = if pick == 0 {
                    counter.packets
                } else {
                    counter.bytes
                };
                let verdict = if reason.is_drop() { "drop" } else { "pass" };
                let _ = writeln!(
                    out,
                    "{family}_total{{namespace=\"{}\",pod=\"{}\",verdict=\"{verdict}\",reason=\"{}\"}} {value}",
                    escape(pod.namespace),
                    escape(pod.pod),
                    reason.label()
                );
            }
        }
    }
    out.push_str("# EOF\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_has_one_family_header_and_escaped_labels() {
        let mut a = Counters::default();
        a.values[Reason::DenyRule as usize] = Counter {
            packets: 3,
            bytes: 180,
        };
        let b = Counters::default();
        let text = render_openmetrics(&[
            PodCounters {
                namespace: "team-a",
                pod: "agent-0",
                counters: &a,
            },
            PodCounters {
                namespace: "x",
                pod: "we\"ird\\",
                counters: &b,
            },
        ]);
        assert_eq!(
            text.matches("# TYPE twig_pod_network_packets counter")
                .count(),
            1
        );
        assert!(text.contains(
            "twig_pod_network_packets_total{namespace=\"team-a\",pod=\"agent-0\",verdict=\"drop\",reason=\"deny_rule\"} 3\n"
        ));
        assert!(text.contains(
            "twig_pod_network_bytes_total{namespace=\"team-a\",pod=\"agent-0\",verdict=\"drop\",reason=\"deny_rule\"} 180\n"
        ));
        assert!(text.contains(r#"pod="we\"ird\\""#), "{text}");
        assert!(text.contains(
            "twig_pod_network_packets_total{namespace=\"team-a\",pod=\"agent-0\",verdict=\"pass\",reason=\"reply\"} 0\n"
        ));
        assert!(text.ends_with("# EOF\n"));
    }
}
