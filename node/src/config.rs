//! The daemon's configuration: a JSON file (`/etc/twig/node.json`, or the
//! file `--config` names); every field has a default, a missing default file
//! means all defaults, and unknown fields are refused.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};

/// Where the configuration is read from unless `--config` names a file.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/twig/node.json";

/// The daemon's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The ttrpc socket serving `twig.v1.Node` and `twig.node.v1.Pool`.
    pub socket: PathBuf,
    /// The node store (`twig_store::NodeStore`): templates and snapshots.
    pub store: PathBuf,
    /// Let the store copy where its filesystem cannot reflink (tests, tmpfs).
    pub allow_copy: bool,
    /// The daemon's runtime directory: one directory per VMM it starts
    /// (`vms/<n>/`: API socket, vsock socket, logs). Kept short: Unix socket
    /// paths are limited to 108 bytes.
    pub run_dir: PathBuf,
    /// The `twig-vmm` binary.
    pub vmm_binary: PathBuf,
    /// Empty disk slots of every VM of the node (and so of every template):
    /// one per app container of a pod (the sandbox container needs none).
    pub disk_slots: u32,
    /// Every VM of the node (and so every template) has a virtio-balloon
    /// device taking the guest's free page reports, so memory a pod frees
    /// goes back to the host (twig-vmm `--balloon`). Templates built
    /// without it are rebuilt (it is in their id).
    pub free_page_reporting: bool,
    /// The node's base template.
    pub base: BaseConfig,
    /// The warm pool.
    pub pool: PoolConfig,
    /// How the pool's VMMs are confined.
    pub jail: JailConfig,
    /// How app templates are built (`EnsureTemplate`).
    pub templates: TemplateBuildConfig,
    /// The pool of prepared twig-net program sets.
    pub net_pool: NetPoolConfig,
    /// The OCI registry snapshots are exported to and imported from.
    pub registry: crate::registry::RegistryConfig,
}

/// The pool of prepared twig-net program sets (maps created, programs
/// verified, pinned and not attached) the shims take for their pods'
/// networks, so no verifier runs on a pod's path.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetPoolConfig {
    /// How many sets to keep ready (0: none; every shim loads its own).
    pub size: usize,
    /// Where the sets are pinned, one directory each; on the same bpffs as
    /// the shims' `bpffs_root` (a set is handed over by a rename), and
    /// never the `bpffs_root` itself (bpffs allows no `.` in names). Created (a bpffs mounted on its
    /// parent if that is on none); emptied and removed when the daemon
    /// stops.
    pub dir: PathBuf,
}

impl Default for NetPoolConfig {
    fn default() -> NetPoolConfig {
        NetPoolConfig {
            size: 8,
            dir: PathBuf::from("/sys/fs/bpf/twig/pool"),
        }
    }
}

/// How `EnsureTemplate` builds an app template: as a pod of the twig
/// runtime handler through containerd's CRI (as kubelet would run it), in
/// the node's network namespace (no CNI address is taken), whose one
/// container runs the image; after the warm-up command exits 0 inside it,
/// the pod's shim snapshots it (a full snapshot) into the node store and
/// the pod is removed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TemplateBuildConfig {
    /// containerd's CRI socket.
    pub cri_socket: PathBuf,
    /// The CRI runtime handler of twig pods.
    pub runtime_handler: String,
    /// containerd's runtime-v2 task directory of CRI's namespace, where
    /// the build pod's bundle names its shim's socket (`address`).
    pub task_dir: PathBuf,
    /// Where the build pods' container logs go (one directory per build,
    /// removed with the pod unless the build failed).
    pub log_dir: PathBuf,
    /// Give up a build (pull, start, warm-up, snapshot) after this many
    /// seconds.
    pub build_timeout_s: u64,
    /// After a failed build, `EnsureTemplate` reports the failure and
    /// starts the next attempt no sooner than this many seconds later.
    pub retry_s: u64,
    /// How many builds run at once on this node (each is a VM, an image
    /// pull and a full snapshot); more wait in line, first asked first
    /// served, and `EnsureTemplate` answers that they are queued. At least 1.
    pub max_concurrent_builds: usize,
}

/// The default `templates.max_concurrent_builds`.
pub const DEFAULT_MAX_CONCURRENT_BUILDS: usize = 2;

/// How twig-node confines every VMM it starts (`twig-vmm serve --jail …`,
/// after Firecracker's jailer): its own mount namespace whose root is an
/// empty per-VMM directory holding only `/dev/kvm`, the VMM's own directory
/// (sockets, console) and the node store's `snapshots` (read-only) and
/// `tmp` (snapshot staging), each bound at its host path; a new, empty
/// network namespace; optionally a new PID namespace and a cgroup; an
/// unprivileged user with no capabilities.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JailConfig {
    /// Jail the VMMs (`false`: they run as the daemon's user, unconfined
    /// but for their seccomp filters).
    pub enabled: bool,
    /// The first of the VMMs' user ids (not 0): each VMM runs as one of
    /// `uid .. uid + ids` of its own, which no other running VMM has.
    pub uid: u32,
    /// How many user ids the VMMs take from `uid` on: at most that many
    /// VMMs run at once.
    pub ids: u32,
    /// The VMMs' group id (not 0).
    pub gid: u32,
    /// Run each VMM as PID 1 of its own PID namespace.
    pub new_pid_ns: bool,
    /// The parent cgroup (relative, in every hierarchy): each VMM runs in
    /// `<cgroup>/<its directory's name>`, removed after it exited. Empty:
    /// the VMMs stay in the daemon's cgroup.
    pub cgroup: PathBuf,
    /// Settings of each VMM's cgroup, `file → value` (e.g. `pids.max`).
    pub cgroup_settings: BTreeMap<String, String>,
    /// Each VMM's open file limit (RLIMIT_NOFILE).
    pub max_files: u64,
}

/// The base templates: what builds them, and their shapes. `mem_mib` ×
/// `vcpus` is the default shape (pods without limits); `shapes` are the
/// others offered to pods whose limits need more (or less). One base
/// template per shape, each built on first need.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BaseConfig {
    /// The guest kernel.
    pub kernel: PathBuf,
    /// twig-agent's initramfs.
    pub initrd: PathBuf,
    /// The default shape's guest RAM, MiB.
    pub mem_mib: u32,
    /// The default shape's vCPUs.
    pub vcpus: u32,
    /// The other shapes offered (the default one may be listed too).
    pub shapes: Vec<BaseShape>,
    /// What a guest keeps of its VM's RAM beyond 1/32 of it, whatever the
    /// pod does, MiB: the guest kernel's code and data, the agent and the
    /// initramfs it lives in. A pod's memory limit must fit in the rest.
    pub guest_reserve_mib: u32,
    /// Give up building one after this many seconds.
    pub build_timeout_s: u64,
}

/// A base template shape offered besides the default one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaseShape {
    /// Guest RAM, MiB.
    pub mem_mib: u32,
    /// vCPUs.
    #[serde(default = "one")]
    pub vcpus: u32,
}

impl BaseConfig {
    /// Every shape offered as (RAM MiB, vCPUs), smallest first (by RAM,
    /// then vCPUs), each once; the default shape among them.
    pub fn offered(&self) -> Vec<(u32, u32)> {
        let mut all: Vec<(u32, u32)> = std::iter::once((self.mem_mib, self.vcpus))
            .chain(self.shapes.iter().map(|s| (s.mem_mib, s.vcpus)))
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

/// The warm pool: how many prepared VMMs of which shapes to keep.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// The shapes kept warm, each with its number of VMMs.
    pub shapes: Vec<PoolShape>,
    /// A VMM that does not answer on its API socket this many seconds
    /// after its start is killed (and the start counts as failed).
    pub start_timeout_s: u64,
}

/// One shape of the pool.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolShape {
    /// Guest RAM, MiB.
    pub mem_mib: u32,
    /// vCPUs.
    #[serde(default = "one")]
    pub vcpus: u32,
    /// How many prepared VMMs of this shape to keep (0: none, every
    /// request spawns one).
    pub size: usize,
}

fn one() -> u32 {
    1
}

impl Default for Config {
    fn default() -> Config {
        Config {
            socket: PathBuf::from("/run/twig/node.sock"),
            store: PathBuf::from("/var/lib/twig/vm"),
            allow_copy: false,
            run_dir: PathBuf::from("/run/twig/node"),
            vmm_binary: PathBuf::from("/usr/local/bin/twig-vmm"),
            disk_slots: 7,
            free_page_reporting: true,
            base: BaseConfig::default(),
            pool: PoolConfig::default(),
            jail: JailConfig::default(),
            net_pool: NetPoolConfig::default(),
            templates: TemplateBuildConfig::default(),
            registry: Default::default(),
        }
    }
}

impl Default for TemplateBuildConfig {
    fn default() -> TemplateBuildConfig {
        TemplateBuildConfig {
            cri_socket: PathBuf::from("/run/containerd/containerd.sock"),
            runtime_handler: "twig".to_string(),
            task_dir: PathBuf::from("/run/containerd/io.containerd.runtime.v2.task/k8s.io"),
            log_dir: PathBuf::from("/var/log/twig/templates"),
            build_timeout_s: 600,
            retry_s: 60,
            max_concurrent_builds: DEFAULT_MAX_CONCURRENT_BUILDS,
        }
    }
}

/// The default `base.guest_reserve_mib`: what the guest kernel and the
/// agent take of a VM's RAM besides 1/32 of it (see the README's *VM
/// shapes*).
pub const DEFAULT_GUEST_RESERVE_MIB: u32 = 28;

/// The largest vCPU count of a shape (twig-vmm's limit).
const MAX_VCPUS: u32 = twig_vmm::MAX_VCPUS as u32;

/// The VMMs' default first user id and their group: a dedicated
/// unprivileged range.
pub const DEFAULT_VMM_ID: u32 = 64242;

/// How many user ids the VMMs take by default (64242–65265, below
/// `nobody`'s 65534).
pub const DEFAULT_VMM_IDS: u32 = 1024;

impl Default for JailConfig {
    fn default() -> JailConfig {
        JailConfig {
            enabled: true,
            uid: DEFAULT_VMM_ID,
            ids: DEFAULT_VMM_IDS,
            gid: DEFAULT_VMM_ID,
            new_pid_ns: true,
            cgroup: PathBuf::from("twig-vmm"),
            cgroup_settings: BTreeMap::new(),
            max_files: 1024,
        }
    }
}

impl Default for BaseConfig {
    fn default() -> BaseConfig {
        BaseConfig {
            kernel: PathBuf::from("/usr/share/twig/vmlinux"),
            initrd: PathBuf::from("/usr/share/twig/agent-initrd.cpio.gz"),
            mem_mib: 256,
            vcpus: 1,
            shapes: vec![
                BaseShape {
                    mem_mib: 512,
                    vcpus: 2,
                },
                BaseShape {
                    mem_mib: 1024,
                    vcpus: 2,
                },
                BaseShape {
                    mem_mib: 2048,
                    vcpus: 4,
                },
            ],
            guest_reserve_mib: DEFAULT_GUEST_RESERVE_MIB,
            build_timeout_s: 300,
        }
    }
}

impl Default for PoolConfig {
    fn default() -> PoolConfig {
        PoolConfig {
            shapes: vec![PoolShape {
                mem_mib: 256,
                vcpus: 1,
                size: 2,
            }],
            start_timeout_s: 10,
        }
    }
}

impl Config {
    /// Reads `path`; a missing file is all defaults unless `required`.
    pub fn from_file(path: &Path, required: bool) -> Result<Config> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {
                let config = Config::default();
                config.validate(path)?;
                return Ok(config);
            }
            Err(e) => {
                return Err(Error::io(
                    format!("reading the node configuration {}", path.display()),
                    e,
                ))
            }
        };
        let config: Config = serde_json::from_str(&text).map_err(|e| {
            Error::InvalidArgument(format!("node configuration {}: {e}", path.display()))
        })?;
        config.validate(path)?;
        Ok(config)
    }

    /// Checks the values serde cannot.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| {
            Error::InvalidArgument(format!("node configuration {}: {m}", path.display()))
        };
        // 11 virtio devices at most: the entropy device, the net device,
        // the vsock and the balloon take four.
        let max_slots = 8 - u32::from(self.free_page_reporting);
        if self.disk_slots == 0 || self.disk_slots > max_slots {
            return Err(bad(format!(
                "disk_slots is {}; it must be 1..={max_slots} (11 virtio devices at most: the \
                 entropy, net and vsock devices{} take the others)",
                self.disk_slots,
                if self.free_page_reporting {
                    " and the balloon (free_page_reporting)"
                } else {
                    ""
                }
            )));
        }
        if self.base.mem_mib < 16 || self.base.vcpus == 0 || self.base.vcpus > MAX_VCPUS {
            return Err(bad(format!(
                "base.mem_mib must be at least 16 and base.vcpus 1..={MAX_VCPUS}"
            )));
        }
        for (i, s) in self.base.shapes.iter().enumerate() {
            if s.mem_mib < 16 || s.vcpus == 0 || s.vcpus > MAX_VCPUS {
                return Err(bad(format!(
                    "base.shapes[{i}]: mem_mib must be at least 16 and vcpus 1..={MAX_VCPUS}"
                )));
            }
            if self.base.shapes[..i]
                .iter()
                .any(|o| o.mem_mib == s.mem_mib && o.vcpus == s.vcpus)
            {
                return Err(bad(format!(
                    "base.shapes[{i}]: {} MiB × {} vCPUs is listed twice",
                    s.mem_mib, s.vcpus
                )));
            }
        }
        let largest = self.base.offered().last().map_or(0, |s| s.0);
        if u64::from(self.base.guest_reserve_mib)
            + u64::from(largest.div_ceil(crate::shape::RESERVE_SHARE))
            >= u64::from(largest)
        {
            return Err(bad(format!(
                "base.guest_reserve_mib {} leaves no room for a pod in any shape",
                self.base.guest_reserve_mib
            )));
        }
        let offered = self.base.offered();
        for (i, s) in self.pool.shapes.iter().enumerate() {
            if s.mem_mib < 16 || s.vcpus == 0 {
                return Err(bad(format!(
                    "pool.shapes[{i}]: mem_mib must be at least 16 and vcpus at least 1"
                )));
            }
            if !offered.contains(&(s.mem_mib, s.vcpus)) {
                return Err(bad(format!(
                    "pool.shapes[{i}]: {} MiB × {} vCPUs is not a base template shape, so no pod \
                     would take its VMMs; offered: {}",
                    s.mem_mib,
                    s.vcpus,
                    list_shapes(&offered)
                )));
            }
            if self.pool.shapes[..i]
                .iter()
                .any(|o| o.mem_mib == s.mem_mib && o.vcpus == s.vcpus)
            {
                return Err(bad(format!(
                    "pool.shapes[{i}]: {} MiB × {} vCPUs is listed twice",
                    s.mem_mib, s.vcpus
                )));
            }
        }
        if !self.net_pool.dir.is_absolute() || self.net_pool.dir.parent().is_none() {
            return Err(bad(format!(
                "net_pool.dir {} must be an absolute directory under a bpffs root",
                self.net_pool.dir.display()
            )));
        }
        if self.pool.start_timeout_s == 0 {
            return Err(bad("pool.start_timeout_s must be at least 1".into()));
        }
        if self.templates.build_timeout_s == 0 || self.templates.runtime_handler.is_empty() {
            return Err(bad(
                "templates.build_timeout_s must be at least 1 and templates.runtime_handler \
                 not empty"
                    .into(),
            ));
        }
        if self.templates.max_concurrent_builds == 0 {
            return Err(bad(
                "templates.max_concurrent_builds must be at least 1".into()
            ));
        }
        if self.jail.enabled {
            if self.jail.uid == 0 || self.jail.gid == 0 {
                return Err(bad(
                    "jail.uid and jail.gid must not be 0 (the VMMs run unprivileged)".into(),
                ));
            }
            if self.jail.cgroup.is_absolute()
                || self
                    .jail
                    .cgroup
                    .components()
                    .any(|c| !matches!(c, Component::Normal(_)))
            {
                return Err(bad(format!(
                    "jail.cgroup {} must be a relative path without `..` (e.g. twig-vmm)",
                    self.jail.cgroup.display()
                )));
            }
            if let Some(f) = self
                .jail
                .cgroup_settings
                .keys()
                .find(|f| f.is_empty() || f.contains('/') || !f.contains('.'))
            {
                return Err(bad(format!(
                    "jail.cgroup_settings: {f:?} is not a cgroup file name like pids.max"
                )));
            }
            if !self.jail.cgroup_settings.is_empty() && self.jail.cgroup.as_os_str().is_empty() {
                return Err(bad("jail.cgroup_settings need a jail.cgroup".into()));
            }
            if self.jail.ids == 0 || self.jail.uid.checked_add(self.jail.ids - 1).is_none() {
                return Err(bad(
                    "jail.ids must be at least 1, and jail.uid + jail.ids - 1 a valid user id"
                        .into(),
                ));
            }
            if self.jail.max_files < 64 {
                return Err(bad("jail.max_files must be at least 64".into()));
            }
        }
        // The VMMs' sockets live in `<run_dir>/vms/<n>/vm/vsock`.
        if self.run_dir.as_os_str().len() > 80 {
            return Err(bad(format!(
                "run_dir {} is too long for Unix socket paths under it (80 bytes at most)",
                self.run_dir.display()
            )));
        }
        Ok(())
    }
}

/// `offered` as `256 MiB × 1 vCPU, 512 MiB × 2 vCPUs` (for messages).
pub fn list_shapes(offered: &[(u32, u32)]) -> String {
    offered
        .iter()
        .map(|(m, v)| format!("{m} MiB × {v} vCPU{}", if *v == 1 { "" } else { "s" }))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_shapes_start_with_the_default_one() {
        let c = Config::default();
        assert_eq!(
            c.base.offered(),
            vec![(256, 1), (512, 2), (1024, 2), (2048, 4)]
        );
        assert_eq!(c.base.guest_reserve_mib, DEFAULT_GUEST_RESERVE_MIB);
        let listed = BaseConfig {
            shapes: vec![BaseShape {
                mem_mib: 256,
                vcpus: 1,
            }],
            ..BaseConfig::default()
        };
        assert_eq!(listed.offered(), vec![(256, 1)], "the default listed again");
        assert_eq!(
            list_shapes(&c.base.offered()[..2]),
            "256 MiB × 1 vCPU, 512 MiB × 2 vCPUs"
        );
    }

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
        let p = dir.path().join("node.json");
        let write = |s: &str| std::fs::write(&p, s).unwrap();
        write(
            r#"{"disk_slots": 4, "base": {"mem_mib": 64}, "pool": {"shapes": [{"mem_mib": 64, "size": 3}]}}"#,
        );
        let c = Config::from_file(&p, true).unwrap();
        assert_eq!(c.disk_slots, 4);
        assert_eq!(
            c.pool.shapes,
            vec![PoolShape {
                mem_mib: 64,
                vcpus: 1,
                size: 3
            }]
        );
        assert_eq!(c.base.mem_mib, 64);
        assert_eq!(
            c.base.offered(),
            vec![(64, 1), (512, 2), (1024, 2), (2048, 4)],
            "the default shapes stay offered"
        );
        assert!(c.jail.enabled, "VMMs are jailed by default");
        assert_eq!((c.jail.uid, c.jail.gid), (DEFAULT_VMM_ID, DEFAULT_VMM_ID));
        assert_eq!(
            c.templates.max_concurrent_builds, DEFAULT_MAX_CONCURRENT_BUILDS,
            "builds are bounded by default"
        );
        write(r#"{"jail": {"enabled": false, "uid": 0}}"#);
        assert!(!Config::from_file(&p, true).unwrap().jail.enabled);
        write(r#"{"templates": {"max_concurrent_builds": 5}}"#);
        assert_eq!(
            Config::from_file(&p, true)
                .unwrap()
                .templates
                .max_concurrent_builds,
            5
        );

        for (text, needle) in [
            (r#"{"disk_slot": 4}"#, "disk_slot"),
            (
                r#"{"pool": {"shapes": [{"mem_mib": 64, "size": 1, "cpus": 2}]}}"#,
                "cpus",
            ),
            (r#"{"disk_slots": 11}"#, "disk_slots is 11"),
            (r#"{"disk_slots": 8}"#, "must be 1..=7"),
            (r#"{"jail": {"uid": 0}}"#, "jail.uid"),
            (r#"{"jail": {"ids": 0}}"#, "jail.ids"),
            (r#"{"jail": {"uid": 4294967295, "ids": 2}}"#, "jail.ids"),
            (r#"{"jail": {"cgroup": "/abs"}}"#, "jail.cgroup"),
            (r#"{"jail": {"cgroup": "a/../b"}}"#, "jail.cgroup"),
            (
                r#"{"jail": {"cgroup_settings": {"pids": "1"}}}"#,
                "not a cgroup file",
            ),
            (r#"{"jail": {"user": 5}}"#, "user"),
            (r#"{"base": {"mem_mib": 8}}"#, "base.mem_mib"),
            (
                r#"{"templates": {"max_concurrent_builds": 0}}"#,
                "templates.max_concurrent_builds must be at least 1",
            ),
            (
                r#"{"pool": {"shapes": [{"mem_mib": 256, "size": 1}, {"mem_mib": 256, "size": 2}]}}"#,
                "listed twice",
            ),
            (r#"{"pool": {"shapes": [{"mem_mib": 64}]}}"#, "size"),
            (
                r#"{"pool": {"shapes": [{"mem_mib": 384, "size": 1}]}}"#,
                "384 MiB × 1 vCPUs is not a base template shape, so no pod would take its VMMs; \
                 offered: 256 MiB × 1 vCPU, 512 MiB × 2 vCPUs",
            ),
            (
                r#"{"base": {"shapes": [{"mem_mib": 512, "vcpus": 0}]}}"#,
                "base.shapes[0]",
            ),
            (
                r#"{"base": {"shapes": [{"mem_mib": 512, "vcpus": 99}]}}"#,
                "vcpus 1..=64",
            ),
            (
                r#"{"base": {"shapes": [{"mem_mib": 512}, {"mem_mib": 512, "vcpus": 1}]}}"#,
                "base.shapes[1]: 512 MiB × 1 vCPUs is listed twice",
            ),
            (
                r#"{"base": {"shapes": [{"mem_mib": 512, "cpus": 2}]}}"#,
                "cpus",
            ),
            (
                r#"{"base": {"shapes": [], "guest_reserve_mib": 256}}"#,
                "base.guest_reserve_mib 256 leaves no room",
            ),
            ("{", "node.json"),
        ] {
            write(text);
            let e = Config::from_file(&p, true).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(needle),
                "{text}: {e}"
            );
        }
    }
}
