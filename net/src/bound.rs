//! The bound on a pod's egress policy: a pod may narrow what its
//! SandboxTemplate (or, without one, the cluster's default) allows, never
//! widen it. [`bounded_policy`] computes the policy that passes exactly what
//! both pass.
//!
//! A policy passes a packet (destination `d`, protocol, port) when no `deny`
//! rule matches, and an `allow` rule matches or (`d` is not private and
//! `defaultAction` is `allow`); the built-in parts (the link-local deny,
//! cluster DNS, the private ranges) are the same in every policy. So the
//! intersection of a pod's policy `P` and its bound `B` is:
//!
//! - `deny` = `P.deny` ∪ `B.deny` (rules kept as written);
//! - `defaultAction` = `allow` only when both allow;
//! - `allow` = the rule-wise intersection `P.allow ∩ B.allow`, plus, when
//!   one side (say `B`) denies by default and the other allows by default,
//!   the other's reach by default: `B.allow` clipped to the non-private
//!   space (each rule's CIDR minus [`PRIVATE_BY_DEFAULT`], its protocol and
//!   ports kept).
//!
//! Two rules intersect in the overlap of their CIDRs (for CIDRs, one
//! contains the other or they are disjoint: the longer prefix), of their
//! protocols (absent = every protocol; absent with ports = TCP and UDP) and
//! of their port ranges (absent = every port). An empty overlap is no rule.
//!
//! `udpReplyPorts` (the pod's UDP ports where a peer's datagram opens a
//! flow the pod may answer) intersect as port sets: the pod's ranges cut to
//! the bound's, merged. A pod cannot open a port to replies its bound does
//! not.
//!
//! A pod policy that reaches past its bound is **clipped**, not refused: it
//! runs with the intersection, and [`Bounded::clipped`] names each field of
//! the pod's policy that was cut (`defaultAction`, `allow[i]`,
//! `udpReplyPorts[i]`), for the
//! caller's Warning. The node's own addresses are private only in the
//! compiled policy (the bound does not know them): a node with a public
//! address that a pod allowing by default reaches through its private tier
//! is reachable by the bounded policy when the bound's `allow` covers it.

use std::net::Ipv4Addr;

use crate::policy::{
    parse_cidr, Action, EgressPolicy, EgressRule, PolicyError, PortRange, Protocol,
    PRIVATE_BY_DEFAULT,
};

/// A pod's policy bounded by its template's or the cluster's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bounded {
    /// What the pod runs with: what both its own policy and the bound pass.
    pub policy: EgressPolicy,
    /// The fields of the pod's own policy that reached past the bound and
    /// were cut, e.g. `allow[0]: 10.0.0.0/8 reaches past …`; empty when the
    /// pod's policy only narrowed the bound.
    pub clipped: Vec<String>,
}

/// An IPv4 network, host bits clear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Net {
    addr: u32,
    len: u8,
}

impl Net {
    fn parse(text: &str) -> Option<Net> {
        parse_cidr(text.trim()).ok().map(|c| Net {
            addr: u32::from(c.addr),
            len: c.prefix_len,
        })
    }

    fn mask(len: u8) -> u32 {
        if len == 0 {
            0
        } else {
            u32::MAX << (32 - len)
        }
    }

    fn contains(self, other: Net) -> bool {
        self.len <= other.len && (other.addr & Net::mask(self.len)) == self.addr
    }

    fn intersect(self, other: Net) -> Option<Net> {
        if self.contains(other) {
            Some(other)
        } else if other.contains(self) {
            Some(self)
        } else {
            None
        }
    }

    fn halves(self) -> (Net, Net) {
        let len = self.len + 1;
        let high = self.addr | (1u32 << (32 - len));
        (
            Net {
                addr: self.addr,
                len,
            },
            Net { addr: high, len },
        )
    }

    /// `self` minus every net of `holes`, as the fewest CIDRs.
    fn minus(self, holes: &[Net]) -> Vec<Net> {
        if holes.iter().any(|h| h.contains(self)) {
            return Vec::new();
        }
        if !holes.iter().any(|h| self.contains(*h)) || self.len == 32 {
            return vec![self];
        }
        let (low, high) = self.halves();
        let mut out = low.minus(holes);
        out.extend(high.minus(holes));
        out
    }

    fn text(self) -> String {
        format!("{}/{}", Ipv4Addr::from(self.addr), self.len)
    }
}

/// The protocols a rule matches: `None` = every protocol.
fn protocols(rule: &EgressRule) -> Option<Vec<Protocol>> {
    match (rule.protocol, rule.ports.is_empty()) {
        (Some(p), _) => Some(vec![p]),
        (None, true) => None,
        (None, false) => Some(vec![Protocol::Tcp, Protocol::Udp]),
    }
}

/// The ports a rule matches, as inclusive ranges: `None` = every port.
fn ports(rule: &EgressRule) -> Option<Vec<(u16, u16)>> {
    (!rule.ports.is_empty()).then(|| {
        rule.ports
            .iter()
            .map(|r| (r.port, r.end_port.unwrap_or(r.port)))
            .collect()
    })
}

/// What both rules match, as rules (none when they do not overlap).
fn intersect_rules(a: &EgressRule, b: &EgressRule) -> Vec<EgressRule> {
    let (Some(na), Some(nb)) = (Net::parse(&a.cidr), Net::parse(&b.cidr)) else {
        return Vec::new();
    };
    let Some(net) = na.intersect(nb) else {
        return Vec::new();
    };
    let protos = match (protocols(a), protocols(b)) {
        (None, other) | (other, None) => other,
        (Some(x), Some(y)) => Some(x.into_iter().filter(|p| y.contains(p)).collect()),
    };
    let port_ranges = match (ports(a), ports(b)) {
        (None, other) | (other, None) => other,
        (Some(x), Some(y)) => Some(
            x.iter()
                .flat_map(|&(s1, e1)| {
                    y.iter().filter_map(move |&(s2, e2)| {
                        let (s, e) = (s1.max(s2), e1.min(e2));
                        (s <= e).then_some((s, e))
                    })
                })
                .collect::<Vec<_>>(),
        ),
    };
    rules_of(net, protos, port_ranges)
}

/// The rules matching `net` on `protos` and `port_ranges` (`None`: every).
fn rules_of(
    net: Net,
    protos: Option<Vec<Protocol>>,
    port_ranges: Option<Vec<(u16, u16)>>,
) -> Vec<EgressRule> {
    let cidr = net.text();
    let ports: Vec<PortRange> = port_ranges
        .iter()
        .flatten()
        .map(|&(port, end)| PortRange {
            port,
            end_port: (end != port).then_some(end),
        })
        .collect();
    if port_ranges.as_ref().is_some_and(Vec::is_empty) {
        return Vec::new();
    }
    match protos {
        None => vec![EgressRule {
            cidr,
            protocol: None,
            ports,
        }],
        Some(protos) => protos
            .into_iter()
            // Ports narrow TCP and UDP; ICMP has none, so a rule with
            // ports never matches it.
            .filter(|p| ports.is_empty() || *p != Protocol::Icmp)
            .map(|p| EgressRule {
                cidr: cidr.clone(),
                protocol: Some(p),
                ports: ports.clone(),
            })
            .collect(),
    }
}

/// `ranges` (inclusive) sorted, overlapping and adjacent ones merged.
fn merged(mut ranges: Vec<(u16, u16)>) -> Vec<(u16, u16)> {
    ranges.sort_unstable();
    let mut out: Vec<(u16, u16)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if u32::from(start) <= u32::from(last.1) + 1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// The inclusive ranges of `ports`.
fn port_pairs(ports: &[PortRange]) -> Vec<(u16, u16)> {
    ports
        .iter()
        .map(|r| (r.port, r.end_port.unwrap_or(r.port)))
        .collect()
}

/// The ports both `a` and `b` hold, merged.
fn intersect_ports(a: &[(u16, u16)], b: &[(u16, u16)]) -> Vec<(u16, u16)> {
    merged(
        a.iter()
            .flat_map(|&(s1, e1)| {
                b.iter().filter_map(move |&(s2, e2)| {
                    let (s, e) = (s1.max(s2), e1.min(e2));
                    (s <= e).then_some((s, e))
                })
            })
            .collect(),
    )
}

fn private_nets() -> Vec<Net> {
    PRIVATE_BY_DEFAULT
        .iter()
        .filter_map(|c| Net::parse(c))
        .collect()
}

/// `rule` clipped to the non-private space.
fn public_part(rule: &EgressRule, private: &[Net]) -> Vec<EgressRule> {
    let Some(net) = Net::parse(&rule.cidr) else {
        return Vec::new();
    };
    net.minus(private)
        .into_iter()
        .map(|n| EgressRule {
            cidr: n.text(),
            ..rule.clone()
        })
        .collect()
}

/// Whether `rule` (of the policy `own`) is wholly passed by `other`'s
/// reach as an allow rule: covered by one of `other`'s allow rules, or by
/// its default when `other` allows by default and `rule` is public, and
/// overlapping none of `other`'s deny rules.
fn covered(rule: &EgressRule, other: &EgressPolicy, private: &[Net]) -> bool {
    let Some(net) = Net::parse(&rule.cidr) else {
        return false;
    };
    let overlaps_deny = other
        .deny
        .iter()
        .any(|d| !intersect_rules(rule, d).is_empty());
    if overlaps_deny {
        return false;
    }
    let by_default = other.default_action == Action::Allow
        && !private.iter().any(|p| p.intersect(net).is_some());
    let whole = rules_of(net, protocols(rule), ports(rule));
    by_default
        || other
            .allow
            .iter()
            .any(|a| intersect_rules(rule, a) == whole)
}

/// The policy passing exactly what both `pod` (the pod's own policy) and
/// `bound` (its SandboxTemplate's, or the cluster's default) pass, and the
/// fields of `pod` that reached past `bound`. Both are validated first
/// (problems under `metadata.annotations[twig.dev/egress-policy]` and
/// `bound_path`); the result is validated too (it may expand to more trie
/// entries than fit).
pub fn bounded_policy(
    pod: &EgressPolicy,
    bound: &EgressPolicy,
    bound_path: &str,
) -> Result<Bounded, PolicyError> {
    let pod_path = format!(
        "metadata.annotations[{}]",
        crate::policy::EGRESS_POLICY_ANNOTATION
    );
    pod.validate().map_err(|e| e.at(&pod_path))?;
    bound.validate().map_err(|e| e.at(bound_path))?;
    let private = private_nets();
    let mut allow: Vec<EgressRule> = Vec::new();
    for a in &pod.allow {
        for b in &bound.allow {
            allow.extend(intersect_rules(a, b));
        }
    }
    // One side allows by default, the other denies: the denying side's
    // allow rules pass where the other reaches by default (public space).
    match (pod.default_action, bound.default_action) {
        (Action::Allow, Action::Deny) => {
            allow.extend(bound.allow.iter().flat_map(|r| public_part(r, &private)));
        }
        (Action::Deny, Action::Allow) => {
            allow.extend(pod.allow.iter().flat_map(|r| public_part(r, &private)));
        }
        _ => {}
    }
    let mut deduped: Vec<EgressRule> = Vec::with_capacity(allow.len());
    for rule in allow {
        if !deduped.contains(&rule) {
            deduped.push(rule);
        }
    }
    let mut deny = pod.deny.clone();
    deny.extend(bound.deny.iter().filter(|r| !pod.deny.contains(r)).cloned());
    let default_action =
        if pod.default_action == Action::Allow && bound.default_action == Action::Allow {
            Action::Allow
        } else {
            Action::Deny
        };
    let pod_udp = port_pairs(&pod.udp_reply_ports);
    let bound_udp = merged(port_pairs(&bound.udp_reply_ports));
    let udp_reply_ports = intersect_ports(&pod_udp, &bound_udp)
        .into_iter()
        .map(|(port, end)| PortRange {
            port,
            end_port: (end != port).then_some(end),
        })
        .collect();
    let policy = EgressPolicy {
        default_action,
        allow: deduped,
        deny,
        udp_reply_ports,
    };
    policy
        .validate()
        .map_err(|e| e.at(&format!("{pod_path} bounded by {bound_path}")))?;
    let mut clipped = Vec::new();
    if pod.default_action == Action::Allow && bound.default_action == Action::Deny {
        clipped.push(format!(
            "defaultAction: allow reaches past {bound_path}, which denies by default; \
             only what it allows passes"
        ));
    }
    for (i, rule) in pod.allow.iter().enumerate() {
        if !covered(rule, bound, &private) {
            clipped.push(format!(
                "allow[{i}]: {} reaches past {bound_path}; only its part {bound_path} allows \
                 passes",
                rule.cidr.trim()
            ));
        }
    }
    for (i, &range) in pod_udp.iter().enumerate() {
        if intersect_ports(&[range], &bound_udp) != [range] {
            let text = match range {
                (port, end) if port == end => port.to_string(),
                (port, end) => format!("{port}–{end}"),
            };
            clipped.push(format!(
                "udpReplyPorts[{i}]: {text} reaches past {bound_path}; only the ports \
                 {bound_path} opens to replies open"
            ));
        }
    }
    Ok(Bounded { policy, clipped })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(cidr: &str, protocol: Option<Protocol>, ports: &[(u16, u16)]) -> EgressRule {
        EgressRule {
            cidr: cidr.into(),
            protocol,
            ports: ports
                .iter()
                .map(|&(port, end)| PortRange {
                    port,
                    end_port: (end != port).then_some(end),
                })
                .collect(),
        }
    }

    fn policy(
        default_action: Action,
        allow: Vec<EgressRule>,
        deny: Vec<EgressRule>,
    ) -> EgressPolicy {
        EgressPolicy {
            default_action,
            allow,
            deny,
            udp_reply_ports: Vec::new(),
        }
    }

    const TPL: &str = "spec.egressPolicy";

    #[test]
    fn a_pod_cannot_reopen_private_ranges_the_default_keeps_closed() {
        let pod = policy(Action::Allow, vec![EgressRule::cidr("10.0.0.0/8")], vec![]);
        let b =
            bounded_policy(&pod, &EgressPolicy::default(), "the cluster's default").expect("valid");
        assert_eq!(b.policy, EgressPolicy::default(), "nothing private opens");
        assert_eq!(b.clipped.len(), 1, "{:?}", b.clipped);
        assert!(
            b.clipped[0].starts_with("allow[0]: 10.0.0.0/8 reaches past"),
            "{:?}",
            b.clipped
        );
    }

    #[test]
    fn narrowing_is_kept_whole_and_not_reported() {
        let template = policy(
            Action::Allow,
            vec![EgressRule::cidr("10.88.0.0/16")],
            vec![rule("0.0.0.0/0", Some(Protocol::Tcp), &[(22, 22)])],
        );
        let pod = policy(
            Action::Allow,
            vec![rule("10.88.1.0/24", Some(Protocol::Tcp), &[(443, 443)])],
            vec![EgressRule::cidr("203.0.113.0/24")],
        );
        let b = bounded_policy(&pod, &template, TPL).expect("valid");
        assert!(b.clipped.is_empty(), "{:?}", b.clipped);
        assert_eq!(b.policy.default_action, Action::Allow);
        assert_eq!(b.policy.allow, pod.allow);
        assert_eq!(
            b.policy.deny,
            vec![
                EgressRule::cidr("203.0.113.0/24"),
                rule("0.0.0.0/0", Some(Protocol::Tcp), &[(22, 22)])
            ],
            "both sides' denies hold"
        );
    }

    #[test]
    fn cidrs_intersect_at_the_longer_prefix_or_not_at_all() {
        let template = policy(Action::Deny, vec![EgressRule::cidr("10.88.0.0/16")], vec![]);
        for (pod_cidr, expected) in [
            ("10.0.0.0/8", Some("10.88.0.0/16")),
            ("10.88.0.0/16", Some("10.88.0.0/16")),
            ("10.88.7.9/32", Some("10.88.7.9/32")),
            ("10.88.7.9", Some("10.88.7.9/32")),
            ("10.89.0.0/16", None),
            ("0.0.0.0/0", Some("10.88.0.0/16")),
        ] {
            let pod = policy(Action::Deny, vec![EgressRule::cidr(pod_cidr)], vec![]);
            let b = bounded_policy(&pod, &template, TPL).expect("valid");
            let got: Vec<&str> = b.policy.allow.iter().map(|r| r.cidr.as_str()).collect();
            assert_eq!(got, expected.into_iter().collect::<Vec<_>>(), "{pod_cidr}");
            let widened = !matches!(pod_cidr, "10.88.0.0/16" | "10.88.7.9/32" | "10.88.7.9");
            assert_eq!(
                !b.clipped.is_empty(),
                widened,
                "{pod_cidr}: {:?}",
                b.clipped
            );
        }
    }

    #[test]
    fn protocols_and_ports_intersect() {
        let template = policy(
            Action::Deny,
            vec![rule("203.0.113.0/24", None, &[(80, 90)])],
            vec![],
        );
        let pod = policy(
            Action::Deny,
            vec![
                rule("203.0.113.0/24", Some(Protocol::Tcp), &[(85, 100), (1, 80)]),
                rule("203.0.113.0/24", Some(Protocol::Icmp), &[]),
                rule("203.0.113.0/24", Some(Protocol::Udp), &[(91, 95)]),
            ],
            vec![],
        );
        let b = bounded_policy(&pod, &template, TPL).expect("valid");
        assert_eq!(
            b.policy.allow,
            vec![rule(
                "203.0.113.0/24",
                Some(Protocol::Tcp),
                &[(85, 90), (80, 80)]
            )],
            "ICMP and UDP 91-95 fall outside TCP/UDP 80-90"
        );
        assert_eq!(b.clipped.len(), 3, "{:?}", b.clipped);
    }

    #[test]
    fn a_template_denying_by_default_bounds_a_pod_allowing_by_default() {
        // The template reaches 10.88/16 and one public API; the pod (its
        // `{}` is allow-by-default) denies one address of that range.
        let template = policy(
            Action::Deny,
            vec![
                EgressRule::cidr("10.88.0.0/16"),
                rule("198.51.100.7/32", Some(Protocol::Tcp), &[(443, 443)]),
            ],
            vec![],
        );
        let pod = policy(
            Action::Allow,
            vec![],
            vec![EgressRule::cidr("198.51.100.7/32")],
        );
        let b = bounded_policy(&pod, &template, TPL).expect("valid");
        assert_eq!(b.policy.default_action, Action::Deny);
        assert_eq!(
            b.policy.allow,
            vec![rule("198.51.100.7/32", Some(Protocol::Tcp), &[(443, 443)])],
            "the pod reaches the public API by default, 10.88/16 it does not allow"
        );
        assert_eq!(b.policy.deny, pod.deny, "and its deny beats that allow");
        assert_eq!(b.clipped.len(), 1);
        assert!(b.clipped[0].starts_with("defaultAction"), "{:?}", b.clipped);
    }

    #[test]
    fn a_pod_denying_by_default_keeps_its_public_allows_under_an_allowing_bound() {
        let pod = policy(Action::Deny, vec![EgressRule::cidr("0.0.0.0/0")], vec![]);
        let b =
            bounded_policy(&pod, &EgressPolicy::default(), "the cluster's default").expect("valid");
        assert_eq!(b.policy.default_action, Action::Deny);
        // 0.0.0.0/0 minus the private ranges: public space only.
        let nets: Vec<Net> = b
            .policy
            .allow
            .iter()
            .filter_map(|r| Net::parse(&r.cidr))
            .collect();
        for private in private_nets() {
            assert!(
                nets.iter().all(|n| n.intersect(private).is_none()),
                "{} stays closed: {nets:?}",
                private.text()
            );
        }
        for public in [
            "1.1.1.1/32",
            "8.8.8.0/24",
            "203.0.113.0/24",
            "172.32.0.0/16",
        ] {
            let p = Net::parse(public).expect("cidr");
            assert!(nets.iter().any(|n| n.contains(p)), "{public} reachable");
        }
        assert_eq!(
            b.clipped.len(),
            1,
            "0.0.0.0/0 covers private space: {:?}",
            b.clipped
        );
    }

    /// Whether `policy` passes a packet, as `bpf/pod.c` decides (without
    /// the built-ins every policy shares).
    fn passes(policy: &EgressPolicy, addr: u32, proto: Protocol, port: u16) -> bool {
        let hits = |r: &EgressRule| {
            let net = Net::parse(&r.cidr).expect("cidr");
            let host = Net { addr, len: 32 };
            net.contains(host)
                && protocols(r).is_none_or(|ps| ps.contains(&proto))
                && ports(r).is_none_or(|rs| {
                    proto != Protocol::Icmp && rs.iter().any(|&(s, e)| s <= port && port <= e)
                })
        };
        if policy.deny.iter().any(hits) {
            return false;
        }
        if policy.allow.iter().any(hits) {
            return true;
        }
        let private = private_nets()
            .iter()
            .any(|n| n.contains(Net { addr, len: 32 }));
        !private && policy.default_action == Action::Allow
    }

    #[test]
    fn the_bounded_policy_passes_exactly_what_both_pass() {
        let policies = [
            EgressPolicy::default(),
            policy(Action::Deny, vec![EgressRule::cidr("10.88.0.0/16")], vec![]),
            policy(
                Action::Allow,
                vec![
                    EgressRule::cidr("10.0.0.0/8"),
                    rule("192.168.1.0/24", None, &[(53, 53)]),
                ],
                vec![rule("8.8.0.0/16", Some(Protocol::Udp), &[])],
            ),
            policy(
                Action::Deny,
                vec![
                    rule("0.0.0.0/0", Some(Protocol::Tcp), &[(443, 443), (80, 81)]),
                    EgressRule::cidr("10.88.4.0/22"),
                ],
                vec![EgressRule::cidr("10.88.5.0/24")],
            ),
            policy(Action::Allow, vec![EgressRule::cidr("0.0.0.0/0")], vec![]),
        ];
        let addrs = [
            "10.88.5.1",
            "10.88.4.9",
            "10.9.0.1",
            "192.168.1.5",
            "192.168.2.5",
            "8.8.8.8",
            "1.1.1.1",
            "172.16.0.1",
            "100.64.0.1",
            "127.0.0.1",
        ];
        let protos = [Protocol::Tcp, Protocol::Udp, Protocol::Icmp];
        for pod in &policies {
            for bound in &policies {
                let b = bounded_policy(pod, bound, TPL).expect("valid");
                for addr in addrs {
                    let addr = u32::from(addr.parse::<Ipv4Addr>().expect("addr"));
                    for proto in protos {
                        for port in [0, 53, 80, 81, 443, 8080] {
                            assert_eq!(
                                passes(&b.policy, addr, proto, port),
                                passes(pod, addr, proto, port) && passes(bound, addr, proto, port),
                                "pod {pod:?} bound {bound:?} -> {:?}: {} {proto:?} {port}",
                                b.policy,
                                Ipv4Addr::from(addr)
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn cidr_difference_is_exact_at_the_edges() {
        let n = |t: &str| Net::parse(t).expect("cidr");
        assert_eq!(n("10.0.0.0/8").minus(&[n("10.0.0.0/8")]), vec![]);
        assert_eq!(n("10.1.0.0/16").minus(&[n("10.0.0.0/8")]), vec![]);
        assert_eq!(
            n("11.0.0.0/8").minus(&[n("10.0.0.0/8")]),
            vec![n("11.0.0.0/8")]
        );
        assert_eq!(
            n("10.0.0.0/7").minus(&[n("10.0.0.0/8")]),
            vec![n("11.0.0.0/8")]
        );
        assert_eq!(
            n("10.0.0.0/30").minus(&[n("10.0.0.2/32")]),
            vec![n("10.0.0.0/31"), n("10.0.0.3/32")]
        );
        assert_eq!(n("0.0.0.0/0").minus(&[n("0.0.0.0/0")]), vec![]);
    }

    #[test]
    fn invalid_inputs_are_errors_naming_where_they_came_from() {
        let bad = policy(Action::Allow, vec![EgressRule::cidr("10.0.0.1/8")], vec![]);
        let e = bounded_policy(&bad, &EgressPolicy::default(), TPL).expect_err("pod");
        assert!(
            e.problems[0].starts_with("metadata.annotations[twig.dev/egress-policy].allow[0].cidr"),
            "{e}"
        );
        let e = bounded_policy(&EgressPolicy::default(), &bad, TPL).expect_err("bound");
        assert!(
            e.problems[0].starts_with("spec.egressPolicy.allow[0].cidr"),
            "{e}"
        );
    }

    fn udp(ports: &[(u16, u16)]) -> Vec<PortRange> {
        ports
            .iter()
            .map(|&(port, end)| PortRange {
                port,
                end_port: (end != port).then_some(end),
            })
            .collect()
    }

    #[test]
    fn udp_reply_ports_beyond_the_bound_are_clipped_and_named() {
        let template = EgressPolicy {
            udp_reply_ports: udp(&[(53, 53), (5000, 5010)]),
            ..EgressPolicy::default()
        };
        let pod = EgressPolicy {
            udp_reply_ports: udp(&[(53, 53), (5005, 5020), (123, 123)]),
            ..EgressPolicy::default()
        };
        let b = bounded_policy(&pod, &template, TPL).expect("valid");
        assert_eq!(b.policy.udp_reply_ports, udp(&[(53, 53), (5005, 5010)]));
        assert_eq!(b.clipped.len(), 2, "{:?}", b.clipped);
        assert!(
            b.clipped[0].starts_with("udpReplyPorts[1]: 5005–5020 reaches past spec.egressPolicy"),
            "{:?}",
            b.clipped
        );
        assert!(
            b.clipped[1].starts_with("udpReplyPorts[2]: 123 reaches past"),
            "{:?}",
            b.clipped
        );
    }

    #[test]
    fn a_pod_opens_no_udp_reply_port_its_bound_does_not() {
        let pod = EgressPolicy {
            udp_reply_ports: udp(&[(53, 53)]),
            ..EgressPolicy::default()
        };
        let b =
            bounded_policy(&pod, &EgressPolicy::default(), "the cluster's default").expect("valid");
        assert!(b.policy.udp_reply_ports.is_empty());
        assert_eq!(b.clipped.len(), 1, "{:?}", b.clipped);
        let none = bounded_policy(&EgressPolicy::default(), &pod, TPL).expect("valid");
        assert!(
            none.policy.udp_reply_ports.is_empty() && none.clipped.is_empty(),
            "narrowing to none is no clip"
        );
    }

    #[test]
    fn udp_reply_ports_within_the_bound_are_kept_and_adjacent_ranges_merge() {
        let template = EgressPolicy {
            udp_reply_ports: udp(&[(50, 59), (60, 69)]),
            ..EgressPolicy::default()
        };
        let pod = EgressPolicy {
            udp_reply_ports: udp(&[(55, 65), (53, 53)]),
            ..EgressPolicy::default()
        };
        let b = bounded_policy(&pod, &template, TPL).expect("valid");
        assert!(b.clipped.is_empty(), "{:?}", b.clipped);
        assert_eq!(b.policy.udp_reply_ports, udp(&[(53, 53), (55, 65)]));
    }

    #[test]
    fn invalid_udp_reply_ports_are_refused_under_their_path() {
        let pod = EgressPolicy {
            udp_reply_ports: udp(&[(9, 8)]),
            ..EgressPolicy::default()
        };
        let err = bounded_policy(&EgressPolicy::default(), &pod, TPL).expect_err("reversed");
        assert!(
            err.to_string()
                .contains("spec.egressPolicy.udpReplyPorts[0].endPort: 8 is below port 9"),
            "{err}"
        );
    }
}
