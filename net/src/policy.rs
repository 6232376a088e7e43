//! The egress policy of a pod: plain serde types (with an optional JSON schema
//! for the controller's CRDs), their validation, and their compilation into
//! entries of the `rules` LPM trie.
//!
//! - **Precedence**: (1) `deny` rules and the built-in link-local deny
//!   ([`ALWAYS_DENIED`], the metadata service) drop; (2) `allow` rules and
//!   the cluster DNS resolvers (UDP/TCP 53, [`NodeContext`]) pass; (3) the
//!   private set ([`PRIVATE_BY_DEFAULT`]: RFC 1918, 100.64.0.0/10, 127/8,
//!   0/8, 224/4, 240/4, and the node's addresses) drops; (4)
//!   `defaultAction` (default `allow`). Deny always beats allow; the
//!   metadata range cannot be allowed. A packet (3) or (4) would drop passes
//!   when it answers a flow the peer started (reply tracking); one (1)
//!   drops does not: a security team reads `deny` as "never".
//! - **Ports**: a rule matches a protocol (`tcp`, `udp`, `icmp`, or all;
//!   ports without a protocol mean TCP and UDP) and destination ports (all
//!   when empty). Each port is one trie entry (generation, tier, protocol,
//!   port, then the prefix); a lookup tries (proto, port), (proto, any),
//!   (any, any) per tier. At most [`MAX_PORTS_PER_RULE`] ports a rule, and
//!   half the trie ([`RULE_CAPACITY`](crate::RULE_CAPACITY)) for a policy,
//!   so an update fits beside the old one.
//! - **Updates are atomic**: the new rules are written as the inactive
//!   generation, one map write flips the active one, then the old is
//!   deleted. A rejected policy changes nothing.
//! - **The annotation replaces, never merges**: a pod's
//!   `twig.dev/egress-policy` replaces its template's policy whole (`{}` is
//!   the built-in default); a malformed one is an error, never a fall-back.
//!   What may widen it is bounded by [`crate::bounded_policy`].
//! - **Unknown fields** are rejected (`deny_unknown_fields`); in a CRD the
//!   schema cannot say so (not structural), so the API server prunes them.
//! - IPv6 CIDRs are rejected: every IPv6 frame from a pod is dropped.

use std::collections::BTreeSet;
use std::fmt;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::maps::{Tier, RULE_CAPACITY, UDP_REPLY_RANGES};

/// Pod annotation holding the pod's own [`EgressPolicy`] as JSON (see
/// [`effective_policy`]); twig-proto's contract defines it.
pub use twig_proto::contract::EGRESS_POLICY_ANNOTATION;

/// Most ports one rule may expand to (each port is one trie entry).
pub const MAX_PORTS_PER_RULE: u32 = 1024;

/// Destinations denied to every pod, whatever its policy says: the IPv4
/// link-local range, which holds the cloud metadata service (169.254.169.254).
pub const ALWAYS_DENIED: &[&str] = &["169.254.0.0/16"];

/// Destinations denied unless an `allow` rule covers them (the node's own
/// addresses are added by the caller): RFC 1918 private ranges, shared address
/// space (RFC 6598, used by carrier-grade NAT and some cluster networks),
/// loopback, "this network", multicast and reserved/broadcast.
pub const PRIVATE_BY_DEFAULT: &[&str] = &[
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "0.0.0.0/8",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// What happens to traffic no rule matches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Pass it (public destinations are reachable).
    #[default]
    Allow,
    /// Drop it (only `allow` rules and cluster DNS are reachable).
    Deny,
}

/// A transport protocol a rule can be narrowed to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP (IP protocol 6).
    Tcp,
    /// UDP (IP protocol 17).
    Udp,
    /// ICMP (IP protocol 1); takes no ports.
    Icmp,
}

impl Protocol {
    fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Icmp => 1,
        }
    }
}

/// One port, or a range `port..=endPort` (as in a Kubernetes
/// NetworkPolicy): a destination's in a rule, the pod's own in
/// `udpReplyPorts`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortRange {
    /// The first (or only) port, 1–65535.
    #[cfg_attr(feature = "schemars", schemars(range(min = 1, max = 65535)))]
    pub port: u16,
    /// The last port of the range, inclusive; a rule's ranges span at most
    /// 1,024 ports each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schemars", schemars(range(min = 1, max = 65535)))]
    pub end_port: Option<u16>,
}

/// One egress rule: a destination CIDR, optionally narrowed to a protocol
/// and destination ports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EgressRule {
    /// Destination IPv4 network, `a.b.c.d/len` (a bare address means `/32`).
    pub cidr: String,
    /// Protocol the rule applies to; every protocol when absent (or TCP and
    /// UDP when ports are given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<Protocol>,
    /// Destination ports; every port when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortRange>,
}

impl EgressRule {
    /// A rule for every protocol and port of `cidr`.
    pub fn cidr(cidr: &str) -> Self {
        Self {
            cidr: cidr.to_owned(),
            protocol: None,
            ports: Vec::new(),
        }
    }
}

/// A pod's egress policy. Precedence: a `deny` match (or the always-denied
/// link-local range) drops; otherwise an `allow` match (or the cluster DNS
/// resolvers on port 53) passes; otherwise a private range or a node address
/// drops; otherwise `defaultAction` decides.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EgressPolicy {
    /// Action for destinations no rule matches (default `allow`).
    #[serde(default)]
    pub default_action: Action,
    /// Destinations the pod may reach, including private ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<EgressRule>,
    /// Destinations the pod may never reach; beats `allow`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<EgressRule>,
    /// The pod's own UDP ports (a server's: DNS on 53, syslog) where a
    /// datagram from a peer opens a flow the pod may answer even where this
    /// policy forbids reaching that peer; at most 8 ranges, none by
    /// default. A pod's list is narrowed to its template's (or the
    /// cluster's), like the rest of the policy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "schemars", schemars(length(max = 8)))]
    pub udp_reply_ports: Vec<PortRange>,
}

/// What the node contributes to every pod's policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// The node's own addresses: denied unless allowed.
    pub node_addrs: Vec<Ipv4Addr>,
    /// The cluster DNS resolvers: UDP and TCP port 53 allowed unless denied.
    pub cluster_dns: Vec<Ipv4Addr>,
}

/// A policy that failed validation: every problem found, each naming the
/// field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid egress policy: {}", .problems.join("; "))]
pub struct PolicyError {
    /// One message per problem, e.g. `deny[1].cidr: ...`.
    pub problems: Vec<String>,
}

impl PolicyError {
    /// The same problems, each placed under `path` (the field or annotation
    /// the policy came from): `allow[0].cidr: …` becomes
    /// `spec.egressPolicy.allow[0].cidr: …`; a problem of the whole policy
    /// becomes `spec.egressPolicy: …`.
    pub fn at(self, path: &str) -> Self {
        let problems = self
            .problems
            .into_iter()
            .map(|p| {
                if p.starts_with("allow[")
                    || p.starts_with("deny[")
                    || p.starts_with("udpReplyPorts")
                {
                    format!("{path}.{p}")
                } else {
                    format!("{path}: {p}")
                }
            })
            .collect();
        Self { problems }
    }
}

/// The policy an annotation or a template names, unbounded: its
/// [`EGRESS_POLICY_ANNOTATION`] (JSON, the annotation's value) when it has
/// one, else its SandboxTemplate's `spec.egressPolicy`,
/// else the built-in default ([`EgressPolicy::default`]: allow public
/// destinations, deny private ones and the metadata range). The chosen
/// policy is validated; every problem names where it came from
/// (`metadata.annotations[twig.dev/egress-policy].allow[0].cidr: …` or
/// `spec.egressPolicy.deny[1].ports[0].endPort: …`). An annotation that is
/// not a policy is an error, never a fallback to the template's. What a pod
/// with an annotation runs with is that policy bounded by its template's
/// (or the default): [`crate::bounded_policy`].
pub fn effective_policy(
    template: Option<&EgressPolicy>,
    annotation: Option<&str>,
) -> Result<EgressPolicy, PolicyError> {
    match annotation {
        Some(text) => parse_policy(
            text,
            &format!("metadata.annotations[{EGRESS_POLICY_ANNOTATION}]"),
        ),
        None => match template {
            Some(policy) => {
                policy.validate().map_err(|e| e.at("spec.egressPolicy"))?;
                Ok(policy.clone())
            }
            None => Ok(EgressPolicy::default()),
        },
    }
}

/// The policy the JSON `text` holds, checked; problems are placed under
/// `path` (where the text came from, e.g. a request's field).
pub fn parse_policy(text: &str, path: &str) -> Result<EgressPolicy, PolicyError> {
    let policy = serde_json::from_str::<EgressPolicy>(text).map_err(|e| PolicyError {
        problems: vec![format!("{path}: not an egress policy: {e}")],
    })?;
    policy.validate().map_err(|e| e.at(path))?;
    Ok(policy)
}

/// One entry of the `rules` trie, generation-independent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Entry {
    pub tier: u8,
    pub proto: u8,
    pub port: u16,
    pub addr: Ipv4Addr,
    pub prefix_len: u8,
}

impl Entry {
    #[cfg(any(test, feature = "loader"))]
    pub fn tier(&self) -> Tier {
        match self.tier {
            0 => Tier::Deny,
            1 => Tier::Allow,
            _ => Tier::Private,
        }
    }
}

/// A validated policy with the node's context, ready to be written to maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompiledPolicy {
    pub(crate) entries: BTreeSet<Entry>,
    pub(crate) deny_by_default: bool,
    /// `pod_config`'s `udp_reply_ports`: inclusive ranges, a range starting
    /// at 0 ends the list.
    pub(crate) udp_reply_ports: [[u16; 2]; UDP_REPLY_RANGES],
}

impl CompiledPolicy {
    /// Number of trie entries the policy takes (a rule takes one per
    /// protocol and port it names).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the policy has no entries at all.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

pub(crate) struct Cidr {
    pub(crate) addr: Ipv4Addr,
    pub(crate) prefix_len: u8,
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

pub(crate) fn parse_cidr(text: &str) -> Result<Cidr, String> {
    let (addr_text, len_text) = text.split_once('/').unwrap_or((text, "32"));
    let addr: Ipv4Addr = match addr_text.parse() {
        Ok(addr) => addr,
        Err(_) if addr_text.contains(':') => {
            return Err(format!(
                "{text:?} is an IPv6 network; IPv6 egress is not supported (every IPv6 frame from a pod is dropped)"
            ))
        }
        Err(_) => return Err(format!("{text:?} is not an IPv4 CIDR (expected a.b.c.d/len)")),
    };
    let prefix_len: u8 = match len_text.parse() {
        Ok(len) if len <= 32 => len,
        _ => return Err(format!("{text:?}: prefix length must be 0–32")),
    };
    let mask = if prefix_len == 0 {
        0
    } else {
        u32::MAX << (32 - prefix_len)
    };
    let bits = u32::from(addr);
    if bits & !mask != 0 {
        let network = Ipv4Addr::from(bits & mask);
        return Err(format!(
            "{text:?} has host bits set (did you mean {network}/{prefix_len}?)"
        ));
    }
    Ok(Cidr { addr, prefix_len })
}

fn compile_rule(
    rule: &EgressRule,
    field: &str,
    tier: Tier,
    out: &mut BTreeSet<Entry>,
    problems: &mut Vec<String>,
) {
    let cidr = match parse_cidr(rule.cidr.trim()) {
        Ok(cidr) => cidr,
        Err(e) => {
            problems.push(format!("{field}.cidr: {e}"));
            return;
        }
    };
    let mut ports = Vec::new();
    for (i, range) in rule.ports.iter().enumerate() {
        let end = range.end_port.unwrap_or(range.port);
        if range.port == 0 {
            problems.push(format!("{field}.ports[{i}].port: must be 1–65535"));
        } else if end < range.port {
            problems.push(format!(
                "{field}.ports[{i}].endPort: {end} is below port {}",
                range.port
            ));
        } else if u32::from(end - range.port) + 1 > MAX_PORTS_PER_RULE {
            problems.push(format!(
                "{field}.ports[{i}]: {}–{end} spans more than {MAX_PORTS_PER_RULE} ports; omit `ports` to match every port",
                range.port
            ));
        } else {
            ports.extend(range.port..=end);
        }
    }
    let protocols: Vec<u8> = match (rule.protocol, rule.ports.is_empty()) {
        (Some(Protocol::Icmp), false) => {
            problems.push(format!("{field}.ports: ICMP has no ports"));
            return;
        }
        (Some(protocol), _) => vec![protocol.number()],
        (None, true) => vec![0],
        (None, false) => vec![Protocol::Tcp.number(), Protocol::Udp.number()],
    };
    if ports.is_empty() {
        ports.push(0);
    }
    for &proto in &protocols {
        for &port in &ports {
            out.insert(Entry {
                tier: tier as u8,
                proto,
                port,
                addr: cidr.addr,
                prefix_len: cidr.prefix_len,
            });
        }
    }
}

/// `udpReplyPorts` as `pod_config` holds it; each problem (port 0, a
/// reversed range, more ranges than fit) is added to `problems`.
fn udp_reply_ranges(
    ports: &[PortRange],
    problems: &mut Vec<String>,
) -> [[u16; 2]; UDP_REPLY_RANGES] {
    let mut ranges = [[0u16; 2]; UDP_REPLY_RANGES];
    if ports.len() > UDP_REPLY_RANGES {
        problems.push(format!(
            "udpReplyPorts: {} ranges given, at most {UDP_REPLY_RANGES} fit",
            ports.len()
        ));
    }
    for (i, range) in ports.iter().enumerate() {
        let end = range.end_port.unwrap_or(range.port);
        if range.port == 0 {
            problems.push(format!("udpReplyPorts[{i}].port: must be 1–65535"));
        } else if end < range.port {
            problems.push(format!(
                "udpReplyPorts[{i}].endPort: {end} is below port {}",
                range.port
            ));
        } else if let Some(slot) = ranges.get_mut(i) {
            *slot = [range.port, end];
        }
    }
    ranges
}

impl EgressPolicy {
    /// Checks the policy, reporting every malformed field at once.
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.compile(&NodeContext::default()).map(|_| ())
    }

    /// Validates the policy and adds the built-in rules (always-denied
    /// link-local, private ranges and node addresses denied unless allowed,
    /// cluster DNS allowed unless denied).
    pub fn compile(&self, node: &NodeContext) -> Result<CompiledPolicy, PolicyError> {
        let mut entries = BTreeSet::new();
        let mut problems = Vec::new();
        for (i, rule) in self.deny.iter().enumerate() {
            compile_rule(
                rule,
                &format!("deny[{i}]"),
                Tier::Deny,
                &mut entries,
                &mut problems,
            );
        }
        for (i, rule) in self.allow.iter().enumerate() {
            compile_rule(
                rule,
                &format!("allow[{i}]"),
                Tier::Allow,
                &mut entries,
                &mut problems,
            );
        }
        let builtin = |cidr: &str| EgressRule::cidr(cidr);
        for cidr in ALWAYS_DENIED {
            compile_rule(
                &builtin(cidr),
                "builtin",
                Tier::Deny,
                &mut entries,
                &mut problems,
            );
        }
        for cidr in PRIVATE_BY_DEFAULT {
            compile_rule(
                &builtin(cidr),
                "builtin",
                Tier::Private,
                &mut entries,
                &mut problems,
            );
        }
        for addr in &node.node_addrs {
            compile_rule(
                &builtin(&addr.to_string()),
                "node",
                Tier::Private,
                &mut entries,
                &mut problems,
            );
        }
        for addr in &node.cluster_dns {
            let dns = EgressRule {
                cidr: addr.to_string(),
                protocol: None,
                ports: vec![PortRange {
                    port: 53,
                    end_port: None,
                }],
            };
            compile_rule(&dns, "clusterDns", Tier::Allow, &mut entries, &mut problems);
        }
        // Both generations share the trie during an update.
        if entries.len() > RULE_CAPACITY / 2 {
            problems.push(format!(
                "the policy expands to {} trie entries (one per protocol and port of each rule); at most {} fit",
                entries.len(),
                RULE_CAPACITY / 2
            ));
        }
        let udp_reply_ports = udp_reply_ranges(&self.udp_reply_ports, &mut problems);
        if problems.is_empty() {
            Ok(CompiledPolicy {
                entries,
                deny_by_default: self.default_action == Action::Deny,
                udp_reply_ports,
            })
        } else {
            Err(PolicyError { problems })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_policy_lists_every_problem_with_its_field() {
        let policy: EgressPolicy = serde_json::from_str(
            r#"{"allow":[{"cidr":"10.0.0.1/8"},{"cidr":"fd00::/8"}],
                "deny":[{"cidr":"1.2.3.0/24","protocol":"icmp","ports":[{"port":1}]},
                        {"cidr":"nonsense"},{"cidr":"1.2.3.4/33"},
                        {"cidr":"1.0.0.0/8","ports":[{"port":0},{"port":9,"endPort":8},{"port":1,"endPort":2000}]}]}"#,
        )
        .expect("parses");
        let err = policy.validate().expect_err("must be rejected");
        let text = err.to_string();
        for expected in [
            "allow[0].cidr: \"10.0.0.1/8\" has host bits set (did you mean 10.0.0.0/8?)",
            "allow[1].cidr: \"fd00::/8\" is an IPv6 network",
            "deny[0].ports: ICMP has no ports",
            "deny[1].cidr: \"nonsense\" is not an IPv4 CIDR",
            "deny[2].cidr: \"1.2.3.4/33\": prefix length must be 0–32",
            "deny[3].ports[0].port: must be 1–65535",
            "deny[3].ports[1].endPort: 8 is below port 9",
            "deny[3].ports[2]: 1–2000 spans more than 1024 ports",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from {text}");
        }
        assert_eq!(err.problems.len(), 8, "{text}");
    }

    fn deny_ssh() -> EgressPolicy {
        EgressPolicy {
            default_action: Action::Allow,
            allow: vec![],
            deny: vec![EgressRule {
                cidr: "0.0.0.0/0".into(),
                protocol: Some(Protocol::Tcp),
                ports: vec![PortRange {
                    port: 22,
                    end_port: None,
                }],
            }],
            udp_reply_ports: vec![],
        }
    }

    #[test]
    fn effective_policy_is_the_default_without_template_or_annotation() {
        assert_eq!(effective_policy(None, None), Ok(EgressPolicy::default()));
        assert_eq!(EgressPolicy::default().default_action, Action::Allow);
    }

    #[test]
    fn effective_policy_is_the_templates_without_an_annotation() {
        let template = deny_ssh();
        assert_eq!(effective_policy(Some(&template), None), Ok(template));
    }

    #[test]
    fn the_annotation_replaces_the_templates_policy_whole() {
        let template = deny_ssh();
        let annotation = r#"{"defaultAction":"deny","allow":[{"cidr":"203.0.113.0/24","protocol":"tcp","ports":[{"port":443}]}]}"#;
        let policy = effective_policy(Some(&template), Some(annotation)).expect("valid");
        assert_eq!(policy.default_action, Action::Deny);
        assert_eq!(policy.allow.len(), 1);
        assert!(policy.deny.is_empty(), "rules are not merged: {policy:?}");
        // `{}` is a policy too: the built-in default, not the template's.
        assert_eq!(
            effective_policy(Some(&template), Some("{}")),
            Ok(EgressPolicy::default())
        );
        assert_eq!(
            effective_policy(None, Some(annotation)),
            Ok(policy),
            "no template needed"
        );
    }

    #[test]
    fn a_malformed_annotation_is_an_error_naming_it_not_a_fallback() {
        let template = deny_ssh();
        for (annotation, expected) in [
            ("", "not an egress policy: EOF while parsing"),
            ("deny all", "not an egress policy: expected value"),
            (r#"{"alow":[]}"#, "unknown field `alow`"),
            (
                r#"{"defaultAction":"block"}"#,
                "unknown variant `block`, expected `allow` or `deny`",
            ),
            (
                r#"{"allow":[{"cidr":"1.2.3.4/8","protocol":"sctp"}]}"#,
                "unknown variant `sctp`",
            ),
            (
                r#"{"allow":[{"cidr":"1.2.3.0/24","ports":[{"port":70000}]}]}"#,
                "70000",
            ),
        ] {
            let err = effective_policy(Some(&template), Some(annotation))
                .expect_err(&format!("{annotation:?} must be rejected"));
            let text = err.to_string();
            assert!(
                text.contains("metadata.annotations[twig.dev/egress-policy]: not an egress policy"),
                "{text}"
            );
            assert!(text.contains(expected), "{expected:?} missing from {text}");
        }
    }

    #[test]
    fn an_invalid_policy_is_rejected_with_the_field_under_where_it_came_from() {
        let annotation = r#"{"allow":[{"cidr":"10.0.0.1/8"}],"deny":[{"cidr":"1.0.0.0/8","ports":[{"port":9,"endPort":8}]}]}"#;
        let err = effective_policy(None, Some(annotation)).expect_err("invalid");
        assert_eq!(
            err.problems,
            vec![
                "metadata.annotations[twig.dev/egress-policy].deny[0].ports[0].endPort: 8 is below port 9",
                "metadata.annotations[twig.dev/egress-policy].allow[0].cidr: \"10.0.0.1/8\" has host bits set (did you mean 10.0.0.0/8?)",
            ]
        );
        let mut template = deny_ssh();
        template.deny[0].cidr = "fd00::/8".into();
        let err = effective_policy(Some(&template), None).expect_err("invalid");
        assert_eq!(err.problems.len(), 1, "{err}");
        assert!(
            err.problems[0]
                .starts_with("spec.egressPolicy.deny[0].cidr: \"fd00::/8\" is an IPv6 network"),
            "{err}"
        );
    }

    #[test]
    fn a_problem_of_the_whole_policy_is_placed_under_the_path() {
        let err = PolicyError {
            problems: vec!["the policy expands to 9 trie entries".into()],
        }
        .at("spec.egressPolicy");
        assert_eq!(
            err.problems,
            vec!["spec.egressPolicy: the policy expands to 9 trie entries"]
        );
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let err =
            serde_json::from_str::<EgressPolicy>(r#"{"alow":[]}"#).expect_err("typo must fail");
        assert!(err.to_string().contains("unknown field `alow`"), "{err}");
    }

    #[test]
    fn compile_expands_ports_and_adds_builtins() {
        let policy = EgressPolicy {
            default_action: Action::Deny,
            allow: vec![EgressRule {
                cidr: "203.0.113.0/24".into(),
                protocol: None,
                ports: vec![PortRange {
                    port: 80,
                    end_port: Some(81),
                }],
            }],
            deny: vec![],
            udp_reply_ports: vec![],
        };
        let node = NodeContext {
            node_addrs: vec![Ipv4Addr::new(192, 0, 2, 7)],
            cluster_dns: vec![Ipv4Addr::new(10, 96, 0, 10)],
        };
        let compiled = policy.compile(&node).expect("valid");
        assert!(compiled.deny_by_default);
        let allow: Vec<_> = compiled
            .entries
            .iter()
            .filter(|e| e.tier() == Tier::Allow)
            .collect();
        // TCP and UDP × ports 80, 81, plus DNS over TCP and UDP.
        assert_eq!(allow.len(), 6);
        assert!(compiled.entries.contains(&Entry {
            tier: 2,
            proto: 0,
            port: 0,
            addr: Ipv4Addr::new(192, 0, 2, 7),
            prefix_len: 32
        }));
        assert!(compiled.entries.contains(&Entry {
            tier: 0,
            proto: 0,
            port: 0,
            addr: Ipv4Addr::new(169, 254, 0, 0),
            prefix_len: 16
        }));
        assert!(compiled.entries.contains(&Entry {
            tier: 1,
            proto: 17,
            port: 53,
            addr: Ipv4Addr::new(10, 96, 0, 10),
            prefix_len: 32
        }));
    }

    #[test]
    fn a_policy_larger_than_the_trie_is_rejected() {
        let allow = (0..40_000u32)
            .map(|i| EgressRule::cidr(&Ipv4Addr::from(0x0b00_0000 + i).to_string()))
            .collect();
        let err = EgressPolicy {
            allow,
            ..Default::default()
        }
        .validate()
        .expect_err("too big");
        assert!(err.to_string().contains("at most 32768 fit"), "{err}");
    }

    #[test]
    fn udp_reply_ports_are_parsed_compiled_and_bad_lists_named() {
        let policy = parse_policy(
            r#"{"udpReplyPorts": [{"port": 53}, {"port": 5000, "endPort": 5010}]}"#,
            "spec.egressPolicy",
        )
        .expect("valid");
        let compiled = policy.compile(&NodeContext::default()).expect("valid");
        assert_eq!(
            compiled.udp_reply_ports[..3],
            [[53, 53], [5000, 5010], [0, 0]]
        );
        assert_eq!(
            EgressPolicy::default()
                .compile(&NodeContext::default())
                .expect("valid")
                .udp_reply_ports,
            [[0, 0]; UDP_REPLY_RANGES],
            "none by default"
        );
        let err = parse_policy(
            r#"{"udpReplyPorts": [{"port": 0}, {"port": 9, "endPort": 8}]}"#,
            "spec.egressPolicy",
        )
        .expect_err("port 0 and a reversed range");
        assert_eq!(
            err.problems,
            [
                "spec.egressPolicy.udpReplyPorts[0].port: must be 1–65535",
                "spec.egressPolicy.udpReplyPorts[1].endPort: 8 is below port 9",
            ]
        );
        let many = (1..=9)
            .map(|p| format!(r#"{{"port": {p}}}"#))
            .collect::<Vec<_>>()
            .join(",");
        let err =
            parse_policy(&format!(r#"{{"udpReplyPorts": [{many}]}}"#), "x").expect_err("too many");
        assert_eq!(
            err.problems,
            ["x.udpReplyPorts: 9 ranges given, at most 8 fit"]
        );
    }
}
