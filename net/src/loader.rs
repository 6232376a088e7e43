//! [`Loader`]: one per process (the node daemon or shim); it attaches pods'
//! paths from a pool of program-and-map sets loaded ahead of time, so a pod's
//! set-up only looks up its interfaces, writes its config and policy, pins
//! and attaches.
//!
//! Off the pod's path: parsing the kernel's BTF (`EbpfLoader::new` does,
//! even when told not to use it; once per process here), loading the ELF
//! (aya cannot load from an object parsed once, so the 36 KB object's parse
//! stays in each set's load), creating the maps and running the verifier.
//! On it: the interface `ioctl`s, 6–10 pins, a few map writes, the two
//! attaches. The caller keeps the pool filled (`preload` after attaches);
//! across processes the node daemon's net pool keeps prepared sets
//! ([`Loader::prepare`], taken by renaming the directory within the bpffs).
//! `attach` `setns`es the calling thread into the pod's namespace and back
//! (no spawned thread); if the way back fails the process aborts rather
//! than stay in the pod's namespace.

use std::path::Path;
use std::sync::{Mutex, PoisonError};

use aya::programs::SchedClassifier;
use aya::{Ebpf, EbpfLoader};

use crate::error::Context;
use crate::flows::FlowTimeouts;
use crate::maps::{
    Attachment, PodConfig, LINK_TAP, LINK_VETH, MODE_NETLINK, MODE_TCX, PIN_NETNS, PIN_PROG_TAP,
    PIN_PROG_VETH, PIN_READY_TAP, PIN_READY_VETH, PROG_TAP, PROG_VETH,
};
use crate::netns::{in_netns, netns_id, open_netns, IfSocket};
use crate::pod::{is_attached, remove_pins, PinGuard, PodNetConfig, PodNetwork};
use crate::policy::{CompiledPolicy, EgressPolicy, NodeContext};
use crate::support::{check_support, check_support_with, AttachMode};
use crate::tc::{self, Attached, FilterGuard};
use crate::{Error, POD_OBJECT};

/// Loads and attaches pods' network paths; keeps a pool of ready sets.
///
/// A set is one instance of the embedded object: its six maps created and
/// both programs loaded (verified), not yet pinned or attached. Loading one
/// (ELF parse, map creation, verifier) is the costly part of a set-up; the
/// pool keeps it off the pod's path. [`Loader::preload`] fills the pool (the
/// caller runs it at start and after attaches, off the pod's path);
/// [`Loader::attach`] takes a set from it, or loads one when it is empty.
pub struct Loader {
    mode: AttachMode,
    pool: Mutex<Vec<Ebpf>>,
    /// Made once: `EbpfLoader::new` parses the kernel's BTF (megabytes, ~10
    /// ms) even when it is then told not to use it.
    ebpf_loader: Mutex<EbpfLoader<'static>>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("mode", &self.mode)
            .field("pooled", &self.pooled())
            .finish()
    }
}

impl Loader {
    /// A loader in the mode [`check_support`] picks (netlink tc filters, or
    /// TCX links when `TWIG_NET_ATTACH_MODE` asks for them).
    /// Fails if the kernel cannot run the path.
    pub fn new() -> Result<Self, Error> {
        Ok(Self::unchecked(check_support()?))
    }

    /// A loader that attaches in `mode`; fails if the kernel cannot.
    pub fn with_mode(mode: AttachMode) -> Result<Self, Error> {
        Ok(Self::unchecked(check_support_with(Some(mode))?))
    }

    fn unchecked(mode: AttachMode) -> Self {
        let mut ebpf_loader = EbpfLoader::new();
        // No CO-RE relocations: the kernel's BTF is not needed.
        ebpf_loader.btf(None);
        Self {
            mode,
            pool: Mutex::new(Vec::new()),
            ebpf_loader: Mutex::new(ebpf_loader),
        }
    }

    /// Loads one set: maps created, programs verified.
    fn load_set(&self) -> Result<Ebpf, Error> {
        let mut ebpf = self
            .ebpf_loader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .load(POD_OBJECT)
            .context(|| "loading the eBPF object (maps)".into())?;
        for name in [PROG_TAP, PROG_VETH] {
            tc::program(&mut ebpf, name)?
                .load()
                .context(|| format!("loading program {name} (verifier)"))?;
        }
        Ok(ebpf)
    }

    /// How this loader attaches programs.
    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    /// How many ready sets the pool holds.
    pub fn pooled(&self) -> usize {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Loads sets until the pool holds `count` (the pool is not locked while
    /// loading, so attaches go on meanwhile).
    pub fn preload(&self, count: usize) -> Result<(), Error> {
        while self.pooled() < count {
            let set = self.load_set()?;
            self.pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(set);
        }
        Ok(())
    }

    /// Loads a set and pins it, unattached, in `dir` (created; it must not
    /// exist): its maps under their names, its programs as `ready_tap` and
    /// `ready_veth`. Whoever holds the pins may move the directory (a
    /// `rename` within the bpffs) and attach it with
    /// [`Loader::attach_prepared`] in any process, with no verifier run on
    /// the way; removing the directory's files frees it. On an error
    /// nothing stays pinned.
    pub fn prepare(&self, dir: &Path) -> Result<(), Error> {
        let mut ebpf = self.load_set()?;
        std::fs::create_dir(dir).map_err(|source| Error::Bpffs {
            path: dir.to_owned(),
            source,
        })?;
        let mut pins = PinGuard { dir, armed: true };
        PodNetwork::from_ebpf(&mut ebpf, dir)?;
        for (name, pin) in [(PROG_TAP, PIN_READY_TAP), (PROG_VETH, PIN_READY_VETH)] {
            tc::program(&mut ebpf, name)?
                .pin(dir.join(pin))
                .context(|| format!("pinning program {name} under {}", dir.display()))?;
        }
        pins.armed = false;
        Ok(())
    }

    fn take_set(&self) -> Result<Ebpf, Error> {
        let pooled = self
            .pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        match pooled {
            Some(set) => Ok(set),
            None => {
                tracing::debug!("twig-net pool empty: loading a set on the pod's path");
                self.load_set()
            }
        }
    }

    /// Joins the pod's veth and tap and starts enforcing `policy`.
    ///
    /// `dir` is the pod's own directory on a bpffs (e.g.
    /// `/sys/fs/bpf/twig/<pod-id>`; see [`crate::ensure_bpffs`] for its parent)
    /// and must not hold a path already. The policy is validated first; the
    /// config and rules are written before anything is attached, so no frame
    /// passes unchecked; on any error nothing stays attached or pinned.
    /// Returns the handle and the veth's MAC, which the guest must use.
    pub fn attach(
        &self,
        dir: &Path,
        config: &PodNetConfig,
        policy: &EgressPolicy,
        node: &NodeContext,
    ) -> Result<(PodNetwork, [u8; 6]), Error> {
        let compiled = policy.compile(node)?;
        if is_attached(dir) {
            return Err(Error::AlreadyAttached(dir.to_owned()));
        }
        let ebpf = self.take_set()?;
        join(dir, config, &compiled, self.mode, Set::Loaded(ebpf))
    }

    /// Like [`Loader::attach`], with the set [`Loader::prepare`] pinned in
    /// `dir` (moved there by whoever prepared it): opens its maps and
    /// programs from the pins instead of loading them, so no loader (and no
    /// parse of the kernel's BTF) is needed. On success the `ready_*` pins
    /// are gone and `dir` holds an attached path; on an error nothing stays
    /// attached or pinned (the set is spent).
    pub fn attach_prepared(
        dir: &Path,
        config: &PodNetConfig,
        policy: &EgressPolicy,
        node: &NodeContext,
        mode: AttachMode,
    ) -> Result<(PodNetwork, [u8; 6]), Error> {
        let compiled = policy.compile(node)?;
        if [LINK_TAP, LINK_VETH, PIN_PROG_TAP, PIN_PROG_VETH]
            .iter()
            .any(|pin| dir.join(pin).symlink_metadata().is_ok())
        {
            return Err(Error::AlreadyAttached(dir.to_owned()));
        }
        for pin in [PIN_READY_TAP, PIN_READY_VETH] {
            if dir.join(pin).symlink_metadata().is_err() {
                return Err(Error::NotPrepared {
                    dir: dir.to_owned(),
                    pin,
                });
            }
        }
        // Spent on any error, also one before the attach pinned anything.
        join(dir, config, &compiled, mode, Set::Prepared).inspect_err(|_| remove_pins(dir))
    }
}

/// Where an attach's programs and maps come from.
enum Set {
    /// Loaded in this process, not pinned yet.
    Loaded(Ebpf),
    /// Pinned in the pod's directory by [`Loader::prepare`].
    Prepared,
}

/// Attaches `set` for the pod: see [`Loader::attach`].
fn join(
    dir: &Path,
    config: &PodNetConfig,
    compiled: &CompiledPolicy,
    mode: AttachMode,
    mut set: Set,
) -> Result<(PodNetwork, [u8; 6]), Error> {
    let netns = &config.netns;
    let file = open_netns(netns)?;
    let (netns_dev, netns_ino) = netns_id(&file, netns)?;
    in_netns(&file, netns, move || {
        let socket = IfSocket::new()?;
        let tap_ifindex = socket.ifindex(&config.tap, netns)?;
        let veth_ifindex = socket.ifindex(&config.veth, netns)?;
        let mac = socket.mac(&config.veth, netns)?;

        std::fs::create_dir_all(dir).map_err(|source| Error::Bpffs {
            path: dir.to_owned(),
            source,
        })?;
        let mut pins = PinGuard { dir, armed: true };
        let mut from_pins: (SchedClassifier, SchedClassifier);
        let (mut pod, tap_program, veth_program) = match &mut set {
            Set::Loaded(ebpf) => {
                let pod = PodNetwork::from_ebpf(ebpf, dir)?;
                let (tap, veth) = tc::two_programs(ebpf, PROG_TAP, PROG_VETH)?;
                (pod, tap, veth)
            }
            Set::Prepared => {
                let pod = PodNetwork::open_maps(dir)?;
                let pinned = |pin: &'static str| {
                    SchedClassifier::from_pin(dir.join(pin))
                        .context(|| format!("opening the prepared program {pin}"))
                };
                from_pins = (pinned(PIN_READY_TAP)?, pinned(PIN_READY_VETH)?);
                let (tap, veth) = (&mut from_pins.0, &mut from_pins.1);
                (pod, tap, veth)
            }
        };
        let [tcp_idle_ms, udp_idle_ms, icmp_idle_ms] = FlowTimeouts::default().to_millis()?;
        pod.write_config(PodConfig {
            pod_ip: config.pod_ip.octets(),
            veth_ifindex,
            tap_ifindex,
            mac,
            pad: 0,
            tcp_idle_ms,
            udp_idle_ms,
            icmp_idle_ms,
            udp_reply_ports: Default::default(),
        })?;
        pod.write_policy(compiled)?;
        let mut record = Attachment {
            mode: MODE_TCX,
            tap_ifindex,
            veth_ifindex,
            ..Attachment::default()
        };
        if mode == AttachMode::Netlink {
            record.mode = MODE_NETLINK;
            record.netns_dev = netns_dev;
            record.netns_ino = netns_ino;
            let target = std::path::absolute(netns).map_err(|source| Error::Netns {
                path: netns.clone(),
                source,
            })?;
            let link = dir.join(PIN_NETNS);
            std::os::unix::fs::symlink(&target, &link)
                .map_err(|source| Error::Bpffs { path: link, source })?;
            for (program, name, pin) in [
                (&mut *tap_program, PROG_TAP, PIN_PROG_TAP),
                (&mut *veth_program, PROG_VETH, PIN_PROG_VETH),
            ] {
                program
                    .pin(dir.join(pin))
                    .context(|| format!("pinning program {name} under {}", dir.display()))?;
            }
        }
        // The config and policy are in place before any frame is seen.
        let (link_tap, link_veth) = (dir.join(LINK_TAP), dir.join(LINK_VETH));
        let (tap, veth) = match mode {
            // Each TCX attach waits for an RCU grace period: attach both
            // at once so the waits overlap. The second thread inherits
            // this thread's network namespace.
            AttachMode::Tcx => std::thread::scope(|scope| {
                let veth = scope
                    .spawn(|| tc::attach(veth_program, PROG_VETH, &config.veth, mode, &link_veth));
                let tap = tc::attach(tap_program, PROG_TAP, &config.tap, mode, &link_tap);
                let veth = veth
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                (tap, veth)
            }),
            // Filters are added without waiting: no second thread.
            AttachMode::Netlink => {
                let tap = tc::attach(tap_program, PROG_TAP, &config.tap, mode, &link_tap);
                let veth = match tap {
                    Ok(_) => tc::attach(veth_program, PROG_VETH, &config.veth, mode, &link_veth),
                    Err(_) => Err(Error::Bpf {
                        what: format!("attaching {PROG_VETH}"),
                        source: "not tried: the tap's attach failed".into(),
                    }),
                };
                (tap, veth)
            }
        };
        let mut filters = FilterGuard::new();
        if let Ok(tap) = tap {
            filters.push(&config.tap, tap);
        }
        if let Ok(veth) = veth {
            filters.push(&config.veth, veth);
        }
        let (tap, veth) = (tap?, veth?);
        if let (
            Attached::Filter {
                prio: tap_prio,
                handle: tap_handle,
            },
            Attached::Filter {
                prio: veth_prio,
                handle: veth_handle,
            },
        ) = (tap, veth)
        {
            record.tap_prio = tap_prio;
            record.tap_handle = tap_handle;
            record.veth_prio = veth_prio;
            record.veth_handle = veth_handle;
        }
        pod.write_attachment(record)?;
        if let Set::Prepared = set {
            for pin in [PIN_READY_TAP, PIN_READY_VETH] {
                let path = dir.join(pin);
                std::fs::remove_file(&path).map_err(|source| Error::Bpffs { path, source })?;
            }
        }
        filters.disarm();
        pins.armed = false;
        tracing::info!(dir = %dir.display(), tap = %config.tap, veth = %config.veth, %mode, entries = compiled.len(), "pod network attached");
        Ok((pod, mac))
    })
}
