//! [`PodNetwork`]: attach, update, re-open and detach one pod's path.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, Map, MapData, PerCpuArray};
use aya::programs::links::{FdLink, LinkOrder, PinnedLink};
use aya::programs::tc::TcAttachOptions;
use aya::programs::{SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader};

use crate::error::Context;
use crate::maps::{
    state_default_index, PodConfig, RawCounter, RuleKey, ALL_PINS, KEY_FIXED_BITS, LINK_TAP,
    LINK_VETH, MAP_CONFIG, MAP_COUNTERS, MAP_RULES, MAP_STATE, PROG_TAP, PROG_VETH,
    STATE_ACTIVE_GEN,
};
use crate::metrics::{Counter, Counters, Reason};
use crate::netns::{ifindex, in_netns, mac_of};
use crate::policy::{CompiledPolicy, EgressPolicy, NodeContext};
use crate::{Error, POD_OBJECT};

/// Where and what to attach.
#[derive(Clone, Debug)]
pub struct PodNetConfig {
    /// The pod's network namespace (`/var/run/netns/<name>`, `/proc/<pid>/ns/net`).
    pub netns: PathBuf,
    /// The pod's veth (CNI's end inside the namespace, e.g. `eth0`).
    pub veth: String,
    /// The VM's tap, already created in the namespace by the VMM.
    pub tap: String,
    /// The pod's IPv4 address (from the CNI result): the only source the guest may use.
    pub pod_ip: Ipv4Addr,
}

/// One pod's attached network path: its maps, opened from their pins.
///
/// Dropping the handle leaves the path attached (its links and maps are
/// pinned); [`PodNetwork::detach`] removes it.
pub struct PodNetwork {
    dir: PathBuf,
    config: Array<MapData, PodConfig>,
    state: Array<MapData, u32>,
    rules: LpmTrie<MapData, RuleKey, u32>,
    counters: PerCpuArray<MapData, RawCounter>,
}

impl std::fmt::Debug for PodNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodNetwork")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Removes whatever pins an attach created if it fails half-way.
struct PinGuard<'a> {
    dir: &'a Path,
    armed: bool,
}

impl Drop for PinGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            remove_pins(self.dir);
        }
    }
}

fn remove_pins(dir: &Path) {
    for pin in ALL_PINS {
        let path = dir.join(pin);
        if let Err(e) = std::fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove pin");
            }
        }
    }
    if let Err(e) = std::fs::remove_dir(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %dir.display(), error = %e, "cannot remove pod pin directory");
        }
    }
}

fn take_map(ebpf: &mut Ebpf, name: &'static str, dir: &Path) -> Result<Map, Error> {
    let map = ebpf.take_map(name).ok_or_else(|| Error::Bpf {
        what: format!("the embedded object has no map {name}"),
        source: "missing map".into(),
    })?;
    map.pin(dir.join(name))
        .context(|| format!("pinning map {name} under {}", dir.display()))?;
    Ok(map)
}

fn attach_program(
    ebpf: &mut Ebpf,
    name: &'static str,
    interface: &str,
    pin: PathBuf,
) -> Result<(), Error> {
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .ok_or_else(|| Error::Bpf {
            what: format!("the embedded object has no program {name}"),
            source: "missing".into(),
        })?
        .try_into()
        .context(|| format!("program {name} is not a tc classifier"))?;
    let link_id = program
        .attach_with_options(
            interface,
            TcAttachType::Ingress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )
        .context(|| format!("attaching {name} to the ingress of {interface}"))?;
    let link = program
        .take_link(link_id)
        .context(|| format!("taking the link of {name}"))?;
    let link: FdLink = link
        .try_into()
        .context(|| format!("the link of {name} is not a BPF link"))?;
    link.pin(&pin)
        .context(|| format!("pinning the link of {name} at {}", pin.display()))?;
    Ok(())
}

fn load_program(ebpf: &mut Ebpf, name: &'static str) -> Result<(), Error> {
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .ok_or_else(|| Error::Bpf {
            what: format!("the embedded object has no program {name}"),
            source: "missing".into(),
        })?
        .try_into()
        .context(|| format!("program {name} is not a tc classifier"))?;
    program
        .load()
        .context(|| format!("loading program {name} (verifier)"))
}

impl PodNetwork {
    /// Joins the pod's veth and tap and starts enforcing `policy`.
    ///
    /// `dir` is the pod's own directory on a bpffs (e.g.
    /// `/sys/fs/bpf/twig/<pod-id>`; see [`crate::ensure_bpffs`] for its parent)
    /// and must not hold a path already. The policy is validated first; on
    /// any error nothing stays attached or pinned. Returns the handle and the
    /// veth's MAC, which the guest must use.
    pub fn attach(
        dir: &Path,
        config: &PodNetConfig,
        policy: &EgressPolicy,
        node: &NodeContext,
    ) -> Result<(Self, [u8; 6]), Error> {
        let compiled = policy.compile(node)?;
        if dir.join(LINK_TAP).exists() || dir.join(LINK_VETH).exists() {
            return Err(Error::AlreadyAttached(dir.to_owned()));
        }
        let netns = config.netns.clone();
        in_netns(&config.netns, move || {
            let tap_ifindex = ifindex(&config.tap, &netns)?;
            let veth_ifindex = ifindex(&config.veth, &netns)?;
            let mac = mac_of(&config.veth)?;

            std::fs::create_dir_all(dir).map_err(|source| Error::Bpffs {
                path: dir.to_owned(),
                source,
            })?;
            let mut guard = PinGuard { dir, armed: true };
            // No CO-RE relocations: skip parsing the kernel's BTF on every attach.
            let mut ebpf = EbpfLoader::new()
                .btf(None)
                .load(POD_OBJECT)
                .context(|| "loading the eBPF object (maps)".into())?;
            load_program(&mut ebpf, PROG_TAP)?;
            load_program(&mut ebpf, PROG_VETH)?;
            let mut pod = PodNetwork {
                dir: dir.to_owned(),
                config: Array::try_from(take_map(&mut ebpf, MAP_CONFIG, dir)?)
                    .context(|| "map config".into())?,
                state: Array::try_from(take_map(&mut ebpf, MAP_STATE, dir)?)
                    .context(|| "map state".into())?,
                rules: LpmTrie::try_from(take_map(&mut ebpf, MAP_RULES, dir)?)
                    .context(|| "map rules".into())?,
                counters: PerCpuArray::try_from(take_map(&mut ebpf, MAP_COUNTERS, dir)?)
                    .context(|| "map counters".into())?,
            };
            let pod_config = PodConfig {
                pod_ip: config.pod_ip.octets(),
                veth_ifindex,
                tap_ifindex,
                mac,
                pad: 0,
            };
            pod.config
                .set(0, pod_config, 0)
                .context(|| "writing the pod's config".into())?;
            pod.write_policy(&compiled)?;
            // The config and policy are in place before any frame is seen.
            attach_program(&mut ebpf, PROG_TAP, &config.tap, dir.join(LINK_TAP))?;
            attach_program(&mut ebpf, PROG_VETH, &config.veth, dir.join(LINK_VETH))?;
            guard.armed = false;
            tracing::info!(dir = %dir.display(), tap = %config.tap, veth = %config.veth, entries = compiled.len(), "pod network attached");
            Ok((pod, mac))
        })
    }

    /// Re-opens a path attached earlier (by this or an earlier process) from
    /// its pins in `dir`.
    pub fn open(dir: &Path) -> Result<Self, Error> {
        for pin in ALL_PINS {
            if !dir.join(pin).exists() {
                return Err(Error::NotAttached {
                    dir: dir.to_owned(),
                    pin,
                });
            }
        }
        let map = |name: &'static str| -> Result<Map, Error> {
            let data = MapData::from_pin(dir.join(name))
                .context(|| format!("opening pinned map {name}"))?;
            Map::from_map_data(data).context(|| format!("pinned map {name}"))
        };
        Ok(PodNetwork {
            dir: dir.to_owned(),
            config: Array::try_from(map(MAP_CONFIG)?).context(|| "pinned map config".into())?,
            state: Array::try_from(map(MAP_STATE)?).context(|| "pinned map state".into())?,
            rules: LpmTrie::try_from(map(MAP_RULES)?).context(|| "pinned map rules".into())?,
            counters: PerCpuArray::try_from(map(MAP_COUNTERS)?)
                .context(|| "pinned map counters".into())?,
        })
    }

    /// The pod's bpffs directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The MAC the guest must use (the veth's).
    pub fn mac(&self) -> Result<[u8; 6], Error> {
        Ok(self
            .config
            .get(&0, 0)
            .context(|| "reading the pod's config".into())?
            .mac)
    }

    /// Replaces the pod's policy in place, without touching the path: the new
    /// rules are written as the inactive generation, then one map write makes
    /// them active, then the old generation is removed. A rejected policy
    /// changes nothing.
    pub fn update_policy(
        &mut self,
        policy: &EgressPolicy,
        node: &NodeContext,
    ) -> Result<(), Error> {
        let compiled = policy.compile(node)?;
        self.write_policy(&compiled)?;
        tracing::info!(dir = %self.dir.display(), entries = compiled.len(), "pod egress policy updated");
        Ok(())
    }

    fn generation_keys(&self, gen: u8) -> Result<Vec<Key<RuleKey>>, Error> {
        let mut keys = Vec::new();
        for key in self.rules.keys() {
            let key = key.context(|| "listing policy rules".into())?;
            if key.data().gen == gen {
                keys.push(key);
            }
        }
        Ok(keys)
    }

    fn remove_generation(&mut self, gen: u8) -> Result<(), Error> {
        for key in self.generation_keys(gen)? {
            self.rules
                .remove(&key)
                .context(|| "removing an old policy rule".into())?;
        }
        Ok(())
    }

    fn write_policy(&mut self, compiled: &CompiledPolicy) -> Result<(), Error> {
        let active = self
            .state
            .get(&STATE_ACTIVE_GEN, 0)
            .context(|| "reading the active generation".into())?;
        let active = (active & 1) as u8;
        let next = active ^ 1;
        // Left over by an update that failed half-way.
        self.remove_generation(next)?;
        for (index, entry) in compiled.entries.iter().enumerate() {
            let key = RuleKey::new(next, entry.tier(), entry.proto, entry.port, entry.addr);
            let key = Key::new(KEY_FIXED_BITS + u32::from(entry.prefix_len), key);
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            if let Err(e) = self.rules.insert(&key, index, 0) {
                // Leave the active generation untouched and clean up.
                let _ = self.remove_generation(next);
                return Err(e).context(|| {
                    format!(
                        "writing policy rule {} ({} of {})",
                        entry.addr,
                        index + 1,
                        compiled.len()
                    )
                });
            }
        }
        self.state
            .set(
                state_default_index(next),
                u32::from(compiled.deny_by_default),
                0,
            )
            .context(|| "writing the default action".into())?;
        self.state
            .set(STATE_ACTIVE_GEN, u32::from(next), 0)
            .context(|| "activating the new policy".into())?;
        self.remove_generation(active)
    }

    /// Reads the pod's counters (summed over CPUs).
    pub fn counters(&self) -> Result<Counters, Error> {
        let mut counters = Counters::default();
        for reason in Reason::ALL {
            let values = self
                .counters
                .get(&(reason as u32), 0)
                .context(|| "reading counters".into())?;
            let sum = values.iter().fold(Counter::default(), |acc, v| Counter {
                packets: acc.packets + v.packets,
                bytes: acc.bytes + v.bytes,
            });
            counters.values[reason as usize] = sum;
        }
        Ok(counters)
    }

    /// Detaches the programs from the veth and tap and removes every pin:
    /// the interfaces are back to carrying nothing between them.
    pub fn detach(self) -> Result<(), Error> {
        for link in [LINK_TAP, LINK_VETH] {
            let path = self.dir.join(link);
            match PinnedLink::from_pin(&path) {
                Ok(pinned) => {
                    let fd_link = pinned
                        .unpin()
                        .context(|| format!("unpinning {}", path.display()))?;
                    drop(fd_link);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "link pin already gone")
                }
            }
        }
        remove_pins(&self.dir);
        tracing::info!(dir = %self.dir.display(), "pod network detached");
        Ok(())
    }
}
