//! [`FlowTimeouts`]: how long a flow a peer started towards the pod may be
//! answered after the peer's last packet; which UDP ports open flows at all.
//!
//! Reply tracking exists so a pod can answer peers its policy keeps it from
//! reaching (a kubelet probe or Service traffic from the node, another pod
//! in RFC 1918 space). `flows` is a preallocated LRU hash of
//! [`FLOW_CAPACITY`](crate::FLOW_CAPACITY) entries (peer, protocol, ports →
//! the time of the peer's last packet); past it the least recently used
//! flow is forgotten and its answers fall back to the policy. It is looked
//! up only when the policy would drop a guest packet for `private` or
//! `default_deny`, so allowed egress is untouched; an answer passes counted
//! under `reply`. It sits after the `deny` tier: a `deny` rule naming a peer
//! drops the answers to it too. Only the peer's packets refresh a flow.
//! TCP is idle for 24 h by default (a server that pushes after a long quiet
//! spell must still reach its client; the guest's SYN is never an answer).
//! `flows` is pinned with the other maps: recorded flows survive a restart
//! of the attaching process, and a clone is a new attach with none. Not
//! conntrack: no "related" ICMP, no TCP state (FIN/RST do not end a flow).
//! A peer that can spoof a source address towards the pod opens a reply
//! window to that address; source validation on the host side of the veth
//! (the CNI's anti-spoofing, `rp_filter`) is what prevents that.
//!
//! What starts a flow is narrow on purpose: a TCP SYN without ACK (later
//! segments only refresh a connection whose SYN was recorded and has not
//! idled out), an ICMP echo request, and a UDP datagram only to a port the
//! pod opted in to (its policy's `udpReplyPorts`, bounded by its template's
//! like the rest of the policy, or
//! [`PodNetwork::set_udp_reply_ports`](crate::PodNetwork::set_udp_reply_ports);
//! none by default: UDP has no SYN, so any datagram would open a window).
//! Recording used to take any segment or datagram, so a collaborator at an
//! address the policy forbids could open a way out of a restricted pod by
//! sending it one (issue 24, item 8). The cost: a connection a peer opened
//! before an attach (a restore) or whose entry was evicted cannot be
//! answered past the policy. A peer that starts a flow still gets what the
//! guest answers on it: the egress policy bounds what the pod starts, and
//! who may start flows towards it is ingress policy (the CNI's
//! NetworkPolicy).

use std::time::Duration;

use crate::maps::UDP_REPLY_RANGES;
use crate::policy::PortRange;
use crate::Error;

/// Idle timeouts of the flows peers start towards a pod (reply tracking).
///
/// `veth_ingress` records the flows peers start towards the pod, with the
/// time of the peer's last packet: a TCP connection by its SYN (without
/// ACK; later segments only refresh a recorded connection), an ICMP echo
/// request, and a UDP datagram only to a port the pod opted in to
/// ([`PodNetwork::set_udp_reply_ports`](crate::PodNetwork::set_udp_reply_ports);
/// none by default). The guest may answer one (destination the peer, ports
/// swapped, the echo's identifier) for this long after that packet, even
/// where its egress policy would drop a packet it started itself. A zero
/// timeout turns replies off for that protocol. Timeouts are kept in whole
/// milliseconds (rounded up) and may be at most `u32::MAX` ms (about 49
/// days).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowTimeouts {
    /// TCP (default 24 h: the guest's SYN never counts as a reply, so a
    /// long-idle entry only lets segments of an existing connection through).
    pub tcp: Duration,
    /// UDP (default 60 s).
    pub udp: Duration,
    /// ICMP echo (default 30 s).
    pub icmp: Duration,
}

impl Default for FlowTimeouts {
    fn default() -> Self {
        Self {
            tcp: Duration::from_secs(24 * 60 * 60),
            udp: Duration::from_secs(60),
            icmp: Duration::from_secs(30),
        }
    }
}

fn millis(protocol: &'static str, timeout: Duration) -> Result<u32, Error> {
    u32::try_from(timeout.as_nanos().div_ceil(1_000_000))
        .map_err(|_| Error::FlowTimeout { protocol, timeout })
}

impl FlowTimeouts {
    /// The TCP, UDP and ICMP timeouts in milliseconds, as `pod_config` holds
    /// them; a timeout too long for that is refused.
    pub(crate) fn to_millis(self) -> Result<[u32; 3], Error> {
        Ok([
            millis("tcp", self.tcp)?,
            millis("udp", self.udp)?,
            millis("icmp", self.icmp)?,
        ])
    }

    /// The timeouts of `pod_config`'s milliseconds.
    pub(crate) fn from_millis([tcp, udp, icmp]: [u32; 3]) -> Self {
        let ms = |v: u32| Duration::from_millis(u64::from(v));
        Self {
            tcp: ms(tcp),
            udp: ms(udp),
            icmp: ms(icmp),
        }
    }
}

/// `pod_config`'s `udp_reply_ports` for `ports`: at most
/// `UDP_REPLY_RANGES` ranges, each `port..=endPort` with `1 <= port <=
/// endPort`; anything else is refused whole.
pub(crate) fn udp_reply_ranges(ports: &[PortRange]) -> Result<[[u16; 2]; UDP_REPLY_RANGES], Error> {
    if ports.len() > UDP_REPLY_RANGES {
        return Err(Error::UdpReplyPorts(format!(
            "{} ranges given, at most {UDP_REPLY_RANGES}",
            ports.len()
        )));
    }
    let mut ranges = [[0u16; 2]; UDP_REPLY_RANGES];
    for (i, (range, slot)) in ports.iter().zip(ranges.iter_mut()).enumerate() {
        let end = range.end_port.unwrap_or(range.port);
        if range.port == 0 {
            return Err(Error::UdpReplyPorts(format!("[{i}].port: 0 is no port")));
        }
        if end < range.port {
            return Err(Error::UdpReplyPorts(format!(
                "[{i}].endPort: {end} is below port {}",
                range.port
            )));
        }
        *slot = [range.port, end];
    }
    Ok(ranges)
}

/// The port ranges of `pod_config`'s `udp_reply_ports`.
pub(crate) fn udp_reply_ports(ranges: &[[u16; 2]; UDP_REPLY_RANGES]) -> Vec<PortRange> {
    ranges
        .iter()
        .take_while(|[first, _]| *first != 0)
        .map(|&[port, end]| PortRange {
            port,
            end_port: (end != port).then_some(end),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_reply_ports_round_trip_and_bad_lists_are_refused() {
        let ports = [
            PortRange {
                port: 53,
                end_port: None,
            },
            PortRange {
                port: 5000,
                end_port: Some(5010),
            },
        ];
        let ranges = udp_reply_ranges(&ports).expect("valid");
        assert_eq!(ranges[..3], [[53, 53], [5000, 5010], [0, 0]]);
        assert_eq!(udp_reply_ports(&ranges), ports);
        assert_eq!(udp_reply_ports(&udp_reply_ranges(&[]).expect("none")), []);
        let one = |port, end_port| [PortRange { port, end_port }];
        let err = udp_reply_ranges(&one(0, None)).expect_err("port 0");
        assert!(err.to_string().contains("[0].port: 0"), "{err}");
        let err = udp_reply_ranges(&one(9, Some(8))).expect_err("reversed");
        assert!(err.to_string().contains("[0].endPort: 8 is below"), "{err}");
        let many = vec![ports[0]; UDP_REPLY_RANGES + 1];
        let err = udp_reply_ranges(&many).expect_err("too many");
        assert!(err.to_string().contains("at most 8"), "{err}");
    }

    #[test]
    fn timeouts_round_up_to_milliseconds_and_too_long_is_refused() {
        let t = FlowTimeouts {
            tcp: Duration::from_micros(1),
            udp: Duration::ZERO,
            icmp: Duration::from_millis(u64::from(u32::MAX)),
        };
        assert_eq!(t.to_millis().expect("valid"), [1, 0, u32::MAX]);
        assert_eq!(
            FlowTimeouts::from_millis(FlowTimeouts::default().to_millis().expect("valid")),
            FlowTimeouts::default()
        );
        let long = FlowTimeouts {
            udp: Duration::from_millis(u64::from(u32::MAX) + 1),
            ..FlowTimeouts::default()
        };
        let err = long.to_millis().expect_err("too long");
        assert!(err.to_string().contains("udp flow idle timeout"), "{err}");
    }
}
