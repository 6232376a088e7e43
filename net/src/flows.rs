//! [`FlowTimeouts`]: how long a flow a peer started towards the pod may be
//! answered after the peer's last packet.

use std::time::Duration;

use crate::Error;

/// Idle timeouts of the flows peers start towards a pod (reply tracking).
///
/// `veth_ingress` records every TCP and UDP flow and every ICMP echo request
/// arriving for the pod, with the time of the peer's last packet; the guest
/// may answer one (destination the peer, ports swapped, the echo's
/// identifier) for this long after that packet, even where its egress policy
/// would drop a packet it started itself. A zero timeout turns replies off
/// for that protocol. Timeouts are kept in whole milliseconds (rounded up)
/// and may be at most `u32::MAX` ms (about 49 days).
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

#[cfg(test)]
mod tests {
    use super::*;

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
