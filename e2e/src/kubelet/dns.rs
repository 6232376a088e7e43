//! A pod's name resolution as kubelet sets it up: the `DNSConfig` of
//! `RunPodSandbox` (`pkg/kubelet/network/dns/dns.go`, `GetPodDNS`), the
//! pod's hostname and domain (`GeneratePodHostNameAndDomain`) and the
//! managed `/etc/hosts` (`pkg/kubelet/kubelet_pods.go`,
//! `managedHostsFileContent`, `nodeHostsFileContent`).

use k8s_openapi::api::core::v1::{HostAlias, PodSpec};
use twig_cri::api;

/// The most nameservers a resolv.conf takes (`validation.MaxDNSNameservers`).
const MAX_NAMESERVERS: usize = 3;
/// The most search domains (`MaxDNSSearchPathsExpanded`).
const MAX_SEARCHES: usize = 32;
/// The longest search line (`MaxDNSSearchListCharsExpanded`).
const MAX_SEARCH_CHARS: usize = 2048;
/// The longest search domain glibc takes (`DNS1123SubdomainMaxLength`).
const MAX_SEARCH_LEN: usize = 253;
/// The longest hostname.
const MAX_HOSTNAME: usize = 63;

/// The node's DNS settings as kubelet's flags give them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeDns {
    /// `--cluster-dns`: the cluster DNS service's addresses.
    pub cluster_dns: Vec<String>,
    /// `--cluster-domain`.
    pub cluster_domain: String,
    /// The node's resolv.conf (`--resolv-conf`) as parsed, or `None` for
    /// kubelet's `--resolv-conf=""`.
    pub host: Option<ResolvConf>,
}

/// A parsed resolv.conf.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvConf {
    /// `nameserver` lines, in order.
    pub servers: Vec<String>,
    /// The last `search` line's domains, trailing dots dropped.
    pub searches: Vec<String>,
    /// The last `options` line's options.
    pub options: Vec<String>,
}

/// Parses a resolv.conf as kubelet's `parseResolvConf` does.
pub fn parse_resolv_conf(text: &str) -> ResolvConf {
    let mut conf = ResolvConf::default();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["nameserver", server, ..] => conf.servers.push(server.to_string()),
            ["search", domains @ ..] => {
                conf.searches = domains
                    .iter()
                    .map(|d| d.trim_end_matches('.').to_string())
                    .collect()
            }
            ["options", options @ ..] => {
                conf.options = options.iter().map(|o| o.to_string()).collect()
            }
            _ => {}
        }
    }
    conf
}

fn omit_duplicates(items: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    items
        .into_iter()
        .filter(|i| seen.insert(i.clone()))
        .collect()
}

/// The pod's `DNSConfig`, by its `dnsPolicy` (`ClusterFirst` by default;
/// on the node's network it means `Default`), with its `dnsConfig` merged
/// in and the result cut to resolv.conf's limits.
pub fn pod_dns(spec: &PodSpec, namespace: &str, node: &NodeDns) -> api::DnsConfig {
    let host_network = spec.host_network == Some(true);
    let host = node.host.clone().unwrap_or_default();
    let mut config = api::DnsConfig {
        servers: host.servers.clone(),
        searches: host.searches.clone(),
        options: host.options.clone(),
    };
    let cluster = match spec.dns_policy.as_deref() {
        Some("None") => {
            config = api::DnsConfig::default();
            None
        }
        Some("ClusterFirstWithHostNet") => Some(true),
        Some("Default") => Some(false),
        // ClusterFirst, and any other value as kubelet falls back to it.
        _ => Some(!host_network),
    };
    let mut use_host = cluster == Some(false);
    if cluster == Some(true) {
        if node.cluster_dns.is_empty() {
            // No cluster DNS configured: kubelet falls back to Default.
            use_host = true;
        } else {
            config.servers = node.cluster_dns.clone();
            if !node.cluster_domain.is_empty() {
                let d = &node.cluster_domain;
                let mut searches = vec![
                    format!("{namespace}.svc.{d}"),
                    format!("svc.{d}"),
                    d.clone(),
                ];
                searches.extend(config.searches);
                config.searches = omit_duplicates(searches);
            }
            config.options = vec!["ndots:5".into()];
        }
    }
    if use_host && node.host.is_none() {
        config.servers = vec!["127.0.0.1".into()];
        config.searches = vec![".".into()];
    }
    if let Some(extra) = &spec.dns_config {
        let mut servers = config.servers;
        servers.extend(extra.nameservers.clone().unwrap_or_default());
        config.servers = omit_duplicates(servers);
        let mut searches = config.searches;
        searches.extend(extra.searches.clone().unwrap_or_default());
        config.searches = omit_duplicates(searches);
        config.options = merge_options(&config.options, extra.options.as_deref().unwrap_or(&[]));
    }
    config.servers.truncate(MAX_NAMESERVERS);
    config.searches = fit_searches(config.searches);
    config
}

/// kubelet's `mergeDNSOptions`: the pod's options override the base's of
/// the same name (kept in first-seen order; kubelet's order is a Go map's).
fn merge_options(
    base: &[String],
    pod: &[k8s_openapi::api::core::v1::PodDNSConfigOption],
) -> Vec<String> {
    let mut merged: Vec<(String, String)> = Vec::new();
    let mut set = |name: &str, value: &str| match merged.iter_mut().find(|(n, _)| n == name) {
        Some(entry) => entry.1 = value.to_string(),
        None => merged.push((name.to_string(), value.to_string())),
    };
    for option in base {
        match option.split_once(':') {
            Some((name, value)) => set(name, value),
            None => set(option, ""),
        }
    }
    for option in pod {
        set(
            option.name.as_deref().unwrap_or_default(),
            option.value.as_deref().unwrap_or_default(),
        );
    }
    merged
        .into_iter()
        .map(|(n, v)| if v.is_empty() { n } else { format!("{n}:{v}") })
        .collect()
}

/// kubelet's `formDNSSearchFitsLimits`.
fn fit_searches(mut searches: Vec<String>) -> Vec<String> {
    searches.truncate(MAX_SEARCHES);
    searches.retain(|s| s.len() <= MAX_SEARCH_LEN);
    while searches.join(" ").len() > MAX_SEARCH_CHARS {
        searches.pop();
    }
    searches
}

/// The pod's hostname and domain: `spec.hostname` or its name (cut to 63
/// characters, trailing `-` and `.` dropped), and with `spec.subdomain`
/// the domain `<subdomain>.<namespace>.svc.<cluster domain>`.
pub fn hostname_and_domain(
    spec: &PodSpec,
    name: &str,
    namespace: &str,
    cluster_domain: &str,
) -> (String, String) {
    let hostname = match spec.hostname.as_deref() {
        Some(h) if !h.is_empty() => h.to_string(),
        _ if name.len() > MAX_HOSTNAME => name[..MAX_HOSTNAME]
            .trim_end_matches(['-', '.'])
            .to_string(),
        _ => name.to_string(),
    };
    let domain = match spec.subdomain.as_deref() {
        Some(sub) if !sub.is_empty() => format!("{sub}.{namespace}.svc.{cluster_domain}"),
        _ => String::new(),
    };
    (hostname, domain)
}

fn host_alias_entries(aliases: &[HostAlias]) -> String {
    if aliases.is_empty() {
        return String::new();
    }
    let mut out = String::from("\n# Entries added by HostAliases.\n");
    for alias in aliases {
        for hostname in alias.hostnames.iter().flatten() {
            out.push_str(&format!("{}\t{hostname}\n", alias.ip));
        }
    }
    out
}

/// The `/etc/hosts` kubelet writes for a pod on its own network.
pub fn managed_hosts(
    ips: &[String],
    hostname: &str,
    domain: &str,
    aliases: &[HostAlias],
) -> String {
    let mut out = String::from(
        "# Kubernetes-managed hosts file.\n\
         127.0.0.1\tlocalhost\n\
         ::1\tlocalhost ip6-localhost ip6-loopback\n\
         fe00::0\tip6-localnet\n\
         fe00::0\tip6-mcastprefix\n\
         fe00::1\tip6-allnodes\n\
         fe00::2\tip6-allrouters\n",
    );
    for ip in ips {
        if domain.is_empty() {
            out.push_str(&format!("{ip}\t{hostname}\n"));
        } else {
            out.push_str(&format!("{ip}\t{hostname}.{domain}\t{hostname}\n"));
        }
    }
    out.push_str(&host_alias_entries(aliases));
    out
}

/// The `/etc/hosts` kubelet writes for a pod on the node's network: the
/// node's own, with the pod's host aliases.
pub fn node_hosts(node_hosts: &str, aliases: &[HostAlias]) -> String {
    format!(
        "# Kubernetes-managed hosts file (host network).\n{node_hosts}{}",
        host_alias_entries(aliases)
    )
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodDNSConfig, PodDNSConfigOption};

    use super::*;

    fn node() -> NodeDns {
        NodeDns {
            cluster_dns: vec!["10.96.0.10".into()],
            cluster_domain: "cluster.local".into(),
            host: Some(parse_resolv_conf(
                "# generated\nnameserver 192.168.1.1\nnameserver 192.168.1.2\nsearch lab.example. corp\noptions edns0 attempts:2\n",
            )),
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_host_resolv_conf_parses_as_kubelet_parses_it() {
        let host = node().host.unwrap_or_default();
        assert_eq!(host.servers, strings(&["192.168.1.1", "192.168.1.2"]));
        assert_eq!(host.searches, strings(&["lab.example", "corp"]));
        assert_eq!(host.options, strings(&["edns0", "attempts:2"]));
    }

    #[test]
    fn cluster_first_uses_the_cluster_dns_the_namespace_searches_and_ndots_5() {
        let dns = pod_dns(&PodSpec::default(), "team", &node());
        assert_eq!(dns.servers, strings(&["10.96.0.10"]));
        assert_eq!(
            dns.searches,
            strings(&[
                "team.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local",
                "lab.example",
                "corp"
            ])
        );
        assert_eq!(dns.options, strings(&["ndots:5"]));
    }

    #[test]
    fn host_network_and_default_use_the_nodes_resolv_conf() {
        let host_net = PodSpec {
            host_network: Some(true),
            ..Default::default()
        };
        let default = PodSpec {
            dns_policy: Some("Default".into()),
            ..Default::default()
        };
        for spec in [host_net, default] {
            let dns = pod_dns(&spec, "team", &node());
            assert_eq!(dns.servers, strings(&["192.168.1.1", "192.168.1.2"]));
            assert_eq!(dns.searches, strings(&["lab.example", "corp"]));
            assert_eq!(dns.options, strings(&["edns0", "attempts:2"]));
        }
        let with_host_net = PodSpec {
            host_network: Some(true),
            dns_policy: Some("ClusterFirstWithHostNet".into()),
            ..Default::default()
        };
        assert_eq!(
            pod_dns(&with_host_net, "t", &node()).servers,
            strings(&["10.96.0.10"])
        );
        // No cluster DNS configured: ClusterFirst falls back to Default; no
        // resolv.conf either: the node's own resolver.
        let bare = NodeDns {
            cluster_dns: Vec::new(),
            cluster_domain: "cluster.local".into(),
            host: None,
        };
        let dns = pod_dns(&PodSpec::default(), "t", &bare);
        assert_eq!(
            (dns.servers, dns.searches),
            (strings(&["127.0.0.1"]), strings(&["."]))
        );
    }

    #[test]
    fn none_takes_the_pods_dns_config_and_others_merge_it() {
        let config = PodDNSConfig {
            nameservers: Some(strings(&["1.1.1.1", "10.96.0.10"])),
            searches: Some(strings(&["my.search", "svc.cluster.local"])),
            options: Some(vec![
                PodDNSConfigOption {
                    name: Some("ndots".into()),
                    value: Some("2".into()),
                },
                PodDNSConfigOption {
                    name: Some("edns0".into()),
                    value: None,
                },
            ]),
        };
        let none = PodSpec {
            dns_policy: Some("None".into()),
            dns_config: Some(config.clone()),
            ..Default::default()
        };
        let dns = pod_dns(&none, "t", &node());
        assert_eq!(dns.servers, strings(&["1.1.1.1", "10.96.0.10"]));
        assert_eq!(dns.searches, strings(&["my.search", "svc.cluster.local"]));
        assert_eq!(dns.options, strings(&["ndots:2", "edns0"]));
        let merged = PodSpec {
            dns_config: Some(config),
            ..Default::default()
        };
        let dns = pod_dns(&merged, "t", &node());
        assert_eq!(dns.servers, strings(&["10.96.0.10", "1.1.1.1"]));
        assert_eq!(dns.searches.last().map(String::as_str), Some("my.search"));
        assert_eq!(dns.options, strings(&["ndots:2", "edns0"]));
    }

    #[test]
    fn limits_cut_nameservers_and_searches() {
        let spec = PodSpec {
            dns_policy: Some("None".into()),
            dns_config: Some(PodDNSConfig {
                nameservers: Some(strings(&["1.1.1.1", "2.2.2.2", "3.3.3.3", "4.4.4.4"])),
                searches: Some((0..40).map(|i| format!("s{i}.example")).collect()),
                options: None,
            }),
            ..Default::default()
        };
        let dns = pod_dns(&spec, "t", &node());
        assert_eq!(dns.servers.len(), 3);
        assert_eq!(dns.searches.len(), 32);
    }

    #[test]
    fn hostname_and_domain_follow_the_pod_spec() {
        let spec = PodSpec {
            subdomain: Some("web".into()),
            ..Default::default()
        };
        assert_eq!(
            hostname_and_domain(&spec, "web-0", "team", "cluster.local"),
            ("web-0".into(), "web.team.svc.cluster.local".into())
        );
        let long = format!("{}-{}", "a".repeat(62), "b");
        assert_eq!(
            hostname_and_domain(&PodSpec::default(), &long, "t", "c").0,
            "a".repeat(62)
        );
    }

    #[test]
    fn the_managed_hosts_file_is_kubelets() {
        let aliases = [HostAlias {
            ip: "10.1.2.3".into(),
            hostnames: Some(strings(&["foo.remote", "bar.remote"])),
        }];
        assert_eq!(
            managed_hosts(
                &strings(&["10.244.0.4"]),
                "web-0",
                "web.team.svc.cluster.local",
                &aliases
            ),
            "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n\
             ::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\n\
             fe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n\
             10.244.0.4\tweb-0.web.team.svc.cluster.local\tweb-0\n\
             \n# Entries added by HostAliases.\n10.1.2.3\tfoo.remote\n10.1.2.3\tbar.remote\n"
        );
        assert!(managed_hosts(&strings(&["10.244.0.4"]), "nginx", "", &[])
            .ends_with("fe00::2\tip6-allrouters\n10.244.0.4\tnginx\n"));
        assert_eq!(
            node_hosts("127.0.0.1 localhost\n", &[]),
            "# Kubernetes-managed hosts file (host network).\n127.0.0.1 localhost\n"
        );
    }
}
