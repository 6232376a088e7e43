//! [`PodNetwork`]: attach, update, re-open and detach one pod's path.

use std::fs::File;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, Map, MapData, PerCpuArray};
use aya::programs::links::PinnedLink;
use aya::Ebpf;

use crate::error::Context;
use crate::flows::{udp_reply_ports, udp_reply_ranges, FlowTimeouts};
use crate::maps::{
    state_default_index, Attachment, PodConfig, RawCounter, RuleKey, ALL_PINS, KEY_FIXED_BITS,
    LINK_TAP, LINK_VETH, MAP_ATTACHMENT, MAP_CONFIG, MAP_COUNTERS, MAP_FLOWS, MAP_PINS, MAP_RULES,
    MAP_STATE, MODE_NETLINK, MODE_TCX, PIN_NETNS, PIN_PROG_TAP, PIN_PROG_VETH, STATE_ACTIVE_GEN,
};
use crate::metrics::{Counter, Counters, Reason};
use crate::netns::{in_netns, netns_id, IfSocket};
use crate::policy::{CompiledPolicy, EgressPolicy, NodeContext, PortRange};
use crate::support::AttachMode;
use crate::tc::detach_filter;
use crate::Error;

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
    attachment: Array<MapData, Attachment>,
}

impl std::fmt::Debug for PodNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodNetwork")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Removes whatever pins an attach created if it fails half-way.
pub(crate) struct PinGuard<'a> {
    /// The pod's directory.
    pub dir: &'a Path,
    /// Whether to remove the pins on drop.
    pub armed: bool,
}

impl Drop for PinGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            remove_pins(self.dir);
        }
    }
}

/// Removes every pin a pod directory may hold, then the directory.
pub(crate) fn remove_pins(dir: &Path) {
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

/// Whether `dir` holds (part of) an attached path.
pub(crate) fn is_attached(dir: &Path) -> bool {
    [
        MAP_ATTACHMENT,
        LINK_TAP,
        LINK_VETH,
        PIN_PROG_TAP,
        PIN_PROG_VETH,
    ]
    .iter()
    .any(|pin| dir.join(pin).symlink_metadata().is_ok())
}

impl PodNetwork {
    /// Takes the maps of a freshly loaded object and pins them in `dir`.
    ///
    /// The `flows` map is only pinned (for inspection, and so it lives as
    /// long as the path): the programs alone read and write it.
    pub(crate) fn from_ebpf(ebpf: &mut Ebpf, dir: &Path) -> Result<Self, Error> {
        take_map(ebpf, MAP_FLOWS, dir)?;
        Ok(PodNetwork {
            dir: dir.to_owned(),
            config: Array::try_from(take_map(ebpf, MAP_CONFIG, dir)?)
                .context(|| "map config".into())?,
            state: Array::try_from(take_map(ebpf, MAP_STATE, dir)?)
                .context(|| "map state".into())?,
            rules: LpmTrie::try_from(take_map(ebpf, MAP_RULES, dir)?)
                .context(|| "map rules".into())?,
            counters: PerCpuArray::try_from(take_map(ebpf, MAP_COUNTERS, dir)?)
                .context(|| "map counters".into())?,
            attachment: Array::try_from(take_map(ebpf, MAP_ATTACHMENT, dir)?)
                .context(|| "map attachment".into())?,
        })
    }

    /// Writes the pod's config (before anything is attached).
    pub(crate) fn write_config(&mut self, config: PodConfig) -> Result<(), Error> {
        self.config
            .set(0, config, 0)
            .context(|| "writing the pod's config".into())
    }

    /// Records where the programs are attached.
    pub(crate) fn write_attachment(&mut self, attachment: Attachment) -> Result<(), Error> {
        self.attachment
            .set(0, attachment, 0)
            .context(|| "recording the attachment".into())
    }

    fn read_attachment(&self) -> Result<(Attachment, AttachMode), Error> {
        let attachment = self
            .attachment
            .get(&0, 0)
            .context(|| "reading the attachment record".into())?;
        let mode = match attachment.mode {
            MODE_TCX => AttachMode::Tcx,
            MODE_NETLINK => AttachMode::Netlink,
            other => {
                return Err(Error::Bpf {
                    what: format!("the attachment record of {}", self.dir.display()),
                    source: format!("unknown mode {other}").into(),
                })
            }
        };
        Ok((attachment, mode))
    }

    /// How the path's programs are attached.
    pub fn mode(&self) -> Result<AttachMode, Error> {
        Ok(self.read_attachment()?.1)
    }

    /// Opens the maps pinned in `dir` (an attached path or a prepared set).
    pub(crate) fn open_maps(dir: &Path) -> Result<Self, Error> {
        for pin in MAP_PINS {
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
            attachment: Array::try_from(map(MAP_ATTACHMENT)?)
                .context(|| "pinned map attachment".into())?,
        })
    }

    /// Re-opens a path attached earlier (by this or an earlier process) from
    /// its pins in `dir`. A directory holding a set that was never attached
    /// (a prepared set, or an attach cut short) is [`Error::NotAttached`].
    pub fn open(dir: &Path) -> Result<Self, Error> {
        let pod = Self::open_maps(dir)?;
        let recorded = pod
            .attachment
            .get(&0, 0)
            .context(|| "reading the attachment record".into())?;
        if recorded.mode == 0 {
            return Err(Error::NotAttached {
                dir: dir.to_owned(),
                pin: MAP_ATTACHMENT,
            });
        }
        let pins: [&'static str; 2] = match pod.mode()? {
            AttachMode::Tcx => [LINK_TAP, LINK_VETH],
            AttachMode::Netlink => [PIN_PROG_TAP, PIN_PROG_VETH],
        };
        for pin in pins {
            if !dir.join(pin).exists() {
                return Err(Error::NotAttached {
                    dir: dir.to_owned(),
                    pin,
                });
            }
        }
        Ok(pod)
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

    /// How long the guest may answer a flow its peer started (see
    /// [`FlowTimeouts`]).
    pub fn flow_timeouts(&self) -> Result<FlowTimeouts, Error> {
        let config = self
            .config
            .get(&0, 0)
            .context(|| "reading the pod's config".into())?;
        Ok(FlowTimeouts::from_millis([
            config.tcp_idle_ms,
            config.udp_idle_ms,
            config.icmp_idle_ms,
        ]))
    }

    /// Changes how long the guest may answer a flow its peer started; takes
    /// effect at once, for flows already recorded too. A timeout too long to
    /// hold changes nothing.
    pub fn set_flow_timeouts(&mut self, timeouts: &FlowTimeouts) -> Result<(), Error> {
        let [tcp, udp, icmp] = timeouts.to_millis()?;
        let mut config = self
            .config
            .get(&0, 0)
            .context(|| "reading the pod's config".into())?;
        config.tcp_idle_ms = tcp;
        config.udp_idle_ms = udp;
        config.icmp_idle_ms = icmp;
        self.write_config(config)?;
        tracing::info!(dir = %self.dir.display(), ?timeouts, "pod flow idle timeouts changed");
        Ok(())
    }

    /// The pod's UDP ports whose datagrams from a peer the guest may answer
    /// (see [`PodNetwork::set_udp_reply_ports`]); empty by default.
    pub fn udp_reply_ports(&self) -> Result<Vec<PortRange>, Error> {
        let config = self
            .config
            .get(&0, 0)
            .context(|| "reading the pod's config".into())?;
        Ok(udp_reply_ports(&config.udp_reply_ports))
    }

    /// Opts the pod in to UDP replies on these ports of its own (at most 8
    /// ranges), replacing any earlier list; `&[]` turns UDP replies off.
    /// The attach and every [`PodNetwork::update_policy`] set the list to
    /// the policy's `udpReplyPorts`, replacing what this set.
    ///
    /// A UDP datagram a peer sends to one of them is recorded as a flow the
    /// guest may answer (from that port, to the peer's address and port,
    /// within the UDP idle timeout) even where its egress policy would drop
    /// the answer — what a UDP server (DNS on 53, syslog, statsd) needs to
    /// answer clients in private space. Datagrams to any other port open
    /// nothing: otherwise anyone the policy keeps the guest from reaching
    /// could open a way out by sending it one. Takes effect at once, for
    /// flows already recorded too; a rejected list changes nothing.
    pub fn set_udp_reply_ports(&mut self, ports: &[PortRange]) -> Result<(), Error> {
        let ranges = udp_reply_ranges(ports)?;
        let mut config = self
            .config
            .get(&0, 0)
            .context(|| "reading the pod's config".into())?;
        config.udp_reply_ports = ranges;
        self.write_config(config)?;
        tracing::info!(dir = %self.dir.display(), ?ports, "pod UDP reply ports changed");
        Ok(())
    }

    /// Replaces the pod's policy in place, without touching the path: the new
    /// rules are written as the inactive generation, then one map write makes
    /// them active, then the old generation is removed; the policy's
    /// `udpReplyPorts` replace the pod's UDP reply ports. A rejected policy
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

    pub(crate) fn write_policy(&mut self, compiled: &CompiledPolicy) -> Result<(), Error> {
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
        let mut config = self
            .config
            .get(&0, 0)
            .context(|| "reading the pod's config".into())?;
        if config.udp_reply_ports != compiled.udp_reply_ports {
            config.udp_reply_ports = compiled.udp_reply_ports;
            self.write_config(config)?;
        }
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
    ///
    /// TCX links go with their pins. Netlink filters are deleted by the
    /// priority and handle recorded at attach, in the namespace recorded at
    /// attach (its file must still name the same namespace; if it is gone,
    /// so are its interfaces and their filters). The `clsact` qdisc stays. On
    /// an error the pins stay, so [`PodNetwork::open`] and `detach` can retry.
    pub fn detach(self) -> Result<(), Error> {
        let (attachment, mode) = self.read_attachment()?;
        match mode {
            AttachMode::Tcx => {
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
            }
            AttachMode::Netlink => self.delete_filters(&attachment)?,
        }
        remove_pins(&self.dir);
        tracing::info!(dir = %self.dir.display(), %mode, "pod network detached");
        Ok(())
    }

    fn delete_filters(&self, attachment: &Attachment) -> Result<(), Error> {
        let link = self.dir.join(PIN_NETNS);
        let netns = std::fs::read_link(&link).map_err(|source| Error::Bpffs {
            path: link.clone(),
            source,
        })?;
        let file = match File::open(&netns) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::info!(netns = %netns.display(), "the pod's namespace is gone, and its filters with it");
                return Ok(());
            }
            Err(source) => {
                return Err(Error::Netns {
                    path: netns,
                    source,
                })
            }
        };
        if netns_id(&file, &netns)? != (attachment.netns_dev, attachment.netns_ino) {
            tracing::info!(netns = %netns.display(), "the file names another namespace now: the pod's is gone, and its filters with it");
            return Ok(());
        }
        in_netns(&file, &netns, || {
            let socket = IfSocket::new()?;
            for (ifindex, prio, handle) in [
                (
                    attachment.tap_ifindex,
                    attachment.tap_prio,
                    attachment.tap_handle,
                ),
                (
                    attachment.veth_ifindex,
                    attachment.veth_prio,
                    attachment.veth_handle,
                ),
            ] {
                match socket.name(ifindex) {
                    Some(interface) => match detach_filter(&interface, prio, handle) {
                        Ok(()) => {}
                        // Whatever the kernel said, an interface that went
                        // meanwhile took its filters with it.
                        Err(e) if socket.name(ifindex).as_deref() != Some(interface.as_str()) => {
                            tracing::info!(ifindex, error = %e, "interface gone while its filter was deleted")
                        }
                        Err(e) => return Err(e),
                    },
                    None => {
                        tracing::info!(ifindex, "interface gone, and its filter with it")
                    }
                }
            }
            Ok(())
        })
    }
}
