//! The shim's configuration: a JSON file, `/etc/twig/shim.json` unless
//! `TWIG_SHIM_CONFIG` names another; every field has a default, and a
//! missing file means all defaults.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use twig_net::EgressPolicy;

use crate::error::{Error, Result};

/// Where the configuration is read from when `TWIG_SHIM_CONFIG` is unset.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/twig/shim.json";

/// The environment variable naming another configuration file.
pub const CONFIG_ENV: &str = "TWIG_SHIM_CONFIG";

/// The shim's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The node daemon's socket (twig-node): the shim asks it for a
    /// prepared VMM and the template to restore into it.
    pub node_socket: PathBuf,
    /// Per-sandbox state (the VMM's pid), one directory per sandbox under
    /// it. Kept short: containerd's bundle paths are long.
    pub state_root: PathBuf,
    /// Deadline for one VMM or agent call on the sandbox's path, seconds.
    pub call_timeout_s: u64,
    /// Deadline for getting a VM from the node daemon, seconds: long
    /// enough for the daemon to build the node's base template on first
    /// need.
    pub acquire_timeout_s: u64,
    /// How many of the node's sandboxes start at once (take their VM,
    /// restore it, wait for its agent); the others wait their turn, within
    /// `acquire_timeout_s`. 0: four per CPU, at least 8.
    pub start_concurrency: usize,
    /// The bpffs directory under which each pod's network path is pinned,
    /// in `<bpffs_root>/<sandbox id>` (mounted if it is not on a bpffs).
    pub bpffs_root: PathBuf,
    /// The cluster's DNS resolvers: the pods' egress policy lets UDP and
    /// TCP port 53 reach them (they are private addresses, denied
    /// otherwise).
    pub cluster_dns: Vec<Ipv4Addr>,
    /// The node's ceiling on a pod's own egress policy (the cluster
    /// admin's, in the form of `twig.dev/egress-policy`): a pod's
    /// annotation is narrowed to it, never opens more; an app template's
    /// pod is narrowed to its template's instead. None: the built-in
    /// default policy.
    pub egress_bound: Option<EgressPolicy>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            node_socket: PathBuf::from("/run/twig/node.sock"),
            state_root: PathBuf::from("/run/twig/shim"),
            call_timeout_s: 30,
            acquire_timeout_s: 360,
            start_concurrency: 0,
            bpffs_root: PathBuf::from("/sys/fs/bpf/twig"),
            cluster_dns: Vec::new(),
            egress_bound: None,
        }
    }
}

impl Config {
    /// Reads the configuration from `TWIG_SHIM_CONFIG` or the default path.
    pub fn load() -> Result<Config> {
        match std::env::var_os(CONFIG_ENV) {
            Some(p) => Config::from_file(Path::new(&p), true),
            None => Config::from_file(Path::new(DEFAULT_CONFIG_PATH), false),
        }
    }

    /// Reads `path`; a missing file is all defaults unless `required`.
    pub fn from_file(path: &Path, required: bool) -> Result<Config> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {
                return Ok(Config::default())
            }
            Err(e) => {
                return Err(Error::io(
                    format!("reading the shim configuration {}", path.display()),
                    e,
                ))
            }
        };
        let config: Config = serde_json::from_str(&text).map_err(|e| {
            Error::InvalidArgument(format!("shim configuration {}: {e}", path.display()))
        })?;
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| {
            Error::InvalidArgument(format!("shim configuration {}: {m}", path.display()))
        };
        if self.call_timeout_s == 0 || self.acquire_timeout_s == 0 {
            return Err(bad(
                "call_timeout_s and acquire_timeout_s must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_is_defaults_unless_required() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("none.json");
        assert_eq!(Config::from_file(&p, false).unwrap(), Config::default());
        let e = Config::from_file(&p, true).unwrap_err();
        assert!(e.to_string().contains("none.json"), "{e}");
    }

    #[test]
    fn partial_files_keep_defaults_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("shim.json");
        std::fs::write(&p, r#"{"node_socket": "/n/node.sock"}"#).unwrap();
        let c = Config::from_file(&p, true).unwrap();
        assert_eq!(c.node_socket, PathBuf::from("/n/node.sock"));
        assert_eq!(c.call_timeout_s, 30);

        // The VM's template and shape are the node daemon's now.
        std::fs::write(&p, r#"{"template": {"dir": "/t"}}"#).unwrap();
        let e = Config::from_file(&p, true).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("template"),
            "{e}"
        );
        std::fs::write(&p, r#"{"acquire_timeout_s": 0}"#).unwrap();
        let e = Config::from_file(&p, true).unwrap_err();
        assert!(e.to_string().contains("acquire_timeout_s"), "{e}");
    }
}
