//! The shim's configuration: a JSON file, `/etc/twig/shim.json` unless
//! `TWIG_SHIM_CONFIG` names another; every field has a default, and a
//! missing file means all defaults.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};

/// Where the configuration is read from when `TWIG_SHIM_CONFIG` is unset.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/twig/shim.json";

/// The environment variable naming another configuration file.
pub const CONFIG_ENV: &str = "TWIG_SHIM_CONFIG";

/// The shim's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The `twig-vmm` binary.
    pub vmm_binary: PathBuf,
    /// Per-sandbox state (API socket, vsock socket, serial log, VMM pid),
    /// one directory per sandbox under it. Kept short: Unix socket paths
    /// are limited to 108 bytes and containerd's bundle paths are long.
    pub state_root: PathBuf,
    /// Empty disk slots of every VM (and so of the template): at most this
    /// many containers per pod, at most 11 virtio devices in all.
    pub disk_slots: usize,
    /// The base template every sandbox VM is restored from.
    pub template: TemplateConfig,
    /// Deadline for one VMM or agent call on the sandbox's path, seconds.
    pub call_timeout_s: u64,
}

/// The base template: where it lives, and what builds it when it is missing.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TemplateConfig {
    /// The template's snapshot directory (made by `twig-vmm template`): a
    /// snapshot of a node store, `<store>/snapshots/<id>`.
    pub dir: PathBuf,
    /// Guest kernel, for building the template.
    pub kernel: PathBuf,
    /// twig-agent's initramfs, for building the template.
    pub initrd: PathBuf,
    /// Guest RAM of the template (and so of every sandbox VM), MiB.
    pub mem_mib: usize,
    /// vCPUs of the template.
    pub vcpus: usize,
    /// Give up building the template after this many seconds.
    pub build_timeout_s: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            vmm_binary: PathBuf::from("/usr/local/bin/twig-vmm"),
            state_root: PathBuf::from("/run/twig/shim"),
            disk_slots: 8,
            template: TemplateConfig::default(),
            call_timeout_s: 30,
        }
    }
}

impl Default for TemplateConfig {
    fn default() -> TemplateConfig {
        TemplateConfig {
            dir: PathBuf::from("/var/lib/twig/vm/snapshots/base"),
            kernel: PathBuf::from("/usr/share/twig/vmlinux"),
            initrd: PathBuf::from("/usr/share/twig/agent-initrd.cpio.gz"),
            mem_mib: 256,
            vcpus: 1,
            build_timeout_s: 300,
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
        if self.disk_slots == 0 || self.disk_slots > 10 {
            return Err(bad(format!(
                "disk_slots is {}; it must be 1..=10 (11 virtio devices at most, one is the vsock)",
                self.disk_slots
            )));
        }
        if self.template.mem_mib < 16 || self.template.vcpus == 0 {
            return Err(bad(
                "template.mem_mib must be at least 16 and template.vcpus at least 1".into(),
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
        std::fs::write(&p, r#"{"disk_slots": 4, "template": {"dir": "/t"}}"#).unwrap();
        let c = Config::from_file(&p, true).unwrap();
        assert_eq!(c.disk_slots, 4);
        assert_eq!(c.template.dir, PathBuf::from("/t"));
        assert_eq!(c.template.mem_mib, 256);

        std::fs::write(&p, r#"{"disk_slot": 4}"#).unwrap();
        let e = Config::from_file(&p, true).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("disk_slot"),
            "{e}"
        );
        std::fs::write(&p, r#"{"disk_slots": 11}"#).unwrap();
        let e = Config::from_file(&p, true).unwrap_err();
        assert!(e.to_string().contains("disk_slots is 11"), "{e}");
    }
}
