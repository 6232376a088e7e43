//! The real sandbox: one `twig-vmm serve` process per pod, taken from the
//! node daemon's warm pool (twig-node: the VM and its memory slots exist
//! already) and restored from a template (never booted on a pod's path),
//! its containers' rootfs images attached to the VM's empty disk slots.

use std::fs::File;
use std::io::{Read, Seek};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use containerd_shim_protos::ttrpc;
use twig_agent::client::AgentClient;
use twig_agent::proto::agent::ReidentifyRequest;
use twig_proto::node::{AcquireVmRequest, AcquireVmResponse};
use twig_proto::node_ttrpc::PoolClient;
use twig_vmm::api::Client;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::gate::StartGate;
use crate::network::{self, Joiner, PodNet};
use crate::restore::{self, SnapshotSource};
use crate::sandbox::{
    Attachment, Death, Launcher, NetworkStats, Restored, Sandbox, VmRollback, VmSnapshot,
    SANDBOX_ADOPTION, TEMPLATE_ADOPTION,
};
use crate::spec;
use twig_net::{EgressPolicy, EGRESS_POLICY_ANNOTATION};

/// The pod annotation naming the app template (a SandboxTemplate of the
/// pod's namespace, built on the node by the node daemon's
/// `EnsureTemplate`) a sandbox restores; without it, the node's base
/// template. `twig.dev/restore-from` wins over it (a Clone's pods carry
/// their source's annotations).
pub const TEMPLATE_ANNOTATION: &str = "twig.dev/template";

/// CRI's annotation of the pod's Kubernetes namespace.
const SANDBOX_NAMESPACE_ANNOTATION: &str = "io.kubernetes.cri.sandbox-namespace";

/// A pod snapshot of the node store a sandbox's VM is restored from,
/// instead of the node's base template.
pub struct RestoreFrom<'a> {
    /// The snapshot's id.
    pub id: String,
    /// The SandboxTemplate (`namespace/name`) when the snapshot is an app
    /// template: its app container is adopted by the pod's first container.
    pub app_template: Option<String>,
    /// The sandbox's OCI spec.
    pub oci: &'a serde_json::Value,
    /// The new sandbox container's rootfs image.
    pub rootfs: &'a Path,
}

/// What the sandbox's spec asks to restore instead of the base template:
/// `twig.dev/restore-from`, else `twig.dev/template` (of the pod's
/// namespace).
pub fn restore_source<'a>(
    oci: &'a serde_json::Value,
    rootfs: &'a Path,
) -> Result<Option<RestoreFrom<'a>>> {
    if let Some(id) = spec::annotation(oci, RESTORE_FROM_ANNOTATION) {
        return Ok(Some(RestoreFrom {
            id: id.to_string(),
            app_template: None,
            oci,
            rootfs,
        }));
    }
    let Some(name) = spec::annotation(oci, TEMPLATE_ANNOTATION) else {
        return Ok(None);
    };
    let namespace = spec::annotation(oci, SANDBOX_NAMESPACE_ANNOTATION).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{TEMPLATE_ANNOTATION}: {name:?} names a SandboxTemplate of the pod's namespace, and              this sandbox has none ({SANDBOX_NAMESPACE_ANNOTATION}): templates are for pods              made through CRI"
        ))
    })?;
    let id = twig_store::layout::template_id(namespace, name)
        .map_err(|e| Error::InvalidArgument(format!("{TEMPLATE_ANNOTATION}: {e}")))?;
    Ok(Some(RestoreFrom {
        id,
        app_template: Some(format!("{namespace}/{name}")),
        oci,
        rootfs,
    }))
}

pub use crate::restore::RESTORE_FROM_ANNOTATION;

/// The least deadline of a snapshot or rollback call: they copy guest
/// memory and disks, which takes seconds on a loaded node.
const SLOW_CALL: Duration = Duration::from_secs(120);

/// How long a ping on the agent connection may take after a rollback
/// before the connection counts as dropped.
const PING_AFTER_ROLLBACK: Duration = Duration::from_millis(500);

/// Makes [`VmSandbox`]es from the shim's configuration.
pub struct VmLauncher {
    config: Config,
    state_dir: PathBuf,
}

impl VmLauncher {
    /// A launcher whose VM keeps its sockets and logs in `state_dir`.
    pub fn new(config: Config, state_dir: PathBuf) -> VmLauncher {
        VmLauncher { config, state_dir }
    }
}

impl Launcher for VmLauncher {
    fn launch(&self, sandbox_id: &str, bundle: &Path, rootfs: &Path) -> Result<Arc<dyn Sandbox>> {
        let spec = spec::read_spec(bundle)?;
        let restore_from = restore_source(&spec, rootfs)?;
        // The pod's limits choose its VM's shape (the node daemon's
        // smallest that fits); bad values fail here, before a VM is taken.
        let resources = spec::pod_resources(&spec)?;
        // The policy is checked before a VM is taken; a kernel that cannot
        // filter the pod's network refuses it at the join, never runs it
        // unfiltered.
        let network = match network::plan(&spec)? {
            Some(plan) => {
                let joiner: Arc<dyn Joiner> = Arc::new(network::Bpf::new(
                    &self.config.cluster_dns,
                    &self.config.node_socket,
                )?);
                Some(NetworkSetup {
                    dir: self.config.bpffs_root.join(sandbox_id),
                    plan,
                    joiner,
                })
            }
            None => None,
        };
        tracing::info!(sandbox_id, restore_from = restore_from.as_ref().map(|r| r.id.as_str()), state = %self.state_dir.display(), network = network.is_some(), memory_limit_bytes = resources.memory_limit_bytes, cpu_limit_millis = resources.cpu_limit_millis, "starting the sandbox VM");
        let hostname = spec
            .get("hostname")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default();
        Ok(Arc::new(VmSandbox::start(
            &self.config,
            &self.state_dir,
            sandbox_id,
            hostname,
            restore_from,
            network,
            resources,
        )?))
    }
}

/// How a sandbox's VM joins its pod's network (CRI pods): after every
/// restore of the VM, [`join_network`].
pub struct NetworkSetup {
    /// The pod's network namespace and egress policy.
    pub plan: network::Plan,
    /// Joins the VM's tap and the pod's veth.
    pub joiner: Arc<dyn Joiner>,
    /// The pod's bpffs directory (`<bpffs_root>/<sandbox id>`).
    pub dir: PathBuf,
}

/// The hook every restore of a pod's VM runs before the first container
/// starts: creates the pod's tap, joins it to the pod's veth, sends it to
/// the VMM and gives the guest the pod's IP, MAC and gateway, so that a
/// VM restored from a template or from another pod's snapshot takes this
/// pod's identity. `state_dir` gets the record `delete` tears the path
/// down with if the shim dies. `own` (the VM's hostname, fresh entropy and
/// the host's clock) goes to the agent in the same Reidentify.
pub fn join_network(
    setup: &NetworkSetup,
    state_dir: &Path,
    api: &mut Client,
    agent: &AgentClient,
    own: &ReidentifyRequest,
    timeout: Duration,
) -> Result<PodNet> {
    PodNet::attach(
        &setup.plan,
        &setup.dir,
        &state_dir.join(network::RECORD_FILE),
        setup.joiner.as_ref(),
        |tap| {
            api.attach_net(tap, timeout)
                .map(|_| ())
                .map_err(vmm_error("sending the pod's tap to twig-vmm"))
        },
        |network| {
            let request = ReidentifyRequest {
                hostname: own.hostname.clone(),
                entropy: own.entropy.clone(),
                realtime_ns: own.realtime_ns,
                ..network.clone()
            };
            agent
                .reidentify(&request, timeout)
                .map(|_| ())
                .map_err(|e| Error::agent("giving the guest the pod's network identity", e))
        },
    )
}

/// A pod's VM: the twig-vmm child, its API client and the agent inside.
pub struct VmSandbox {
    vmm: Mutex<Vmm>,
    agent: RwLock<AgentConn>,
    vsock: PathBuf,
    /// The template the VM was restored from (`<store>/snapshots/<id>`).
    template_dir: PathBuf,
    slots: Mutex<Vec<bool>>,
    timeout: Duration,
    /// Set before a shutdown stops the VMM: its exit is then no death.
    stopping: Arc<AtomicBool>,
    /// What the watch thread says when the VMM dies unasked, until taken.
    death: Mutex<Option<Death>>,
    /// The shim's state directory of the pod (`vmm.pid`), removed once
    /// the VMM is gone.
    state_dir: PathBuf,
    /// Containers of the pod snapshot the VM was restored from (restore-
    /// from) not adopted yet.
    restored: Mutex<Vec<Restored>>,
    /// The pod's network attached to the VM, torn down once it stopped.
    network: Mutex<Option<PodNet>>,
    /// The pod's network path, whose policy changes while the pod runs.
    path: Option<PathControl>,
}

/// The policy side of a pod's network path: what joined it, where it is
/// pinned, and the policy in force.
struct PathControl {
    joiner: Arc<dyn Joiner>,
    dir: PathBuf,
    policy: Mutex<EgressPolicy>,
}

/// The agent connection and how many times it was replaced.
struct AgentConn {
    client: AgentClient,
    epoch: u64,
}

struct Vmm {
    process: Option<Process>,
    api: Client,
}

fn vmm_error(what: impl Into<String>) -> impl FnOnce(twig_vmm::api::ClientError) -> Error {
    let what = what.into();
    move |source| Error::Vmm { what, source }
}

impl VmSandbox {
    /// Takes a prepared VMM from the node daemon (`config.node_socket`) of
    /// the shape that fits `resources` (the daemon chooses; a pod that
    /// fits none is refused before any VM is taken), restores the node's
    /// base template of that shape into it — or, with
    /// `restore_from`, that pod snapshot (or app template) of the
    /// template's store, then gives the clone its own identity — and
    /// connects to its agent. On failure the VMM is killed.
    pub fn start(
        config: &Config,
        state_dir: &Path,
        sandbox_id: &str,
        hostname: &str,
        restore_from: Option<RestoreFrom<'_>>,
        mut network: Option<NetworkSetup>,
        resources: spec::PodResources,
    ) -> Result<VmSandbox> {
        std::fs::create_dir_all(state_dir)
            .map_err(|e| Error::io(format!("creating {}", state_dir.display()), e))?;
        // A few starts of the node at a time (crate::gate), this one's
        // slot held until its VM answers or it failed.
        let permit = StartGate::new(&config.state_root, config.start_concurrency)
            .enter(Duration::from_secs(config.acquire_timeout_s))?;
        let started = Instant::now();
        // The daemon reads a restore-from snapshot's shape before it hands
        // over a VM: one that is not there is refused before any is taken.
        let vm = acquire(
            config,
            sandbox_id,
            restore_from.as_ref().map(|r| r.id.as_str()),
            resources,
        )
        .map_err(|e| match (e, &restore_from) {
            (Error::NotFound(m), Some(r)) => Error::NotFound(match &r.app_template {
                Some(name) => not_built(name, &r.id),
                None => format!("{RESTORE_FROM_ANNOTATION}: {m}"),
            }),
            (e, _) => e,
        })?;
        let acquired = started.elapsed();
        let process = Process::open(vm.pid, &vm.api_socket)?;
        let mut guard = KillOnDrop(Some(process), state_dir.to_path_buf());
        // Recorded for `delete` after a crash of this shim: the pid, and
        // the API socket its command line must name.
        std::fs::write(
            state_dir.join(PID_FILE),
            format!("{}\n{}\n", vm.pid, vm.api_socket),
        )
        .map_err(|e| Error::io(format!("writing {}/{PID_FILE}", state_dir.display()), e))?;
        let timeout = Duration::from_secs(config.call_timeout_s);
        let vm_dir = PathBuf::from(&vm.state_dir);
        // Opened now: twig-node removes the VMM's directory once it reaped
        // it, and a death is explained with what these files say.
        let logs = VmLogs::open(&vm_dir);
        let source = restore_from
            .map(|r| {
                let source = SnapshotSource::open(
                    Path::new(&vm.template_dir),
                    &r.id,
                    r.oci,
                    sandbox_id,
                    r.rootfs,
                );
                match r.app_template {
                    None => source,
                    Some(name) => source
                        .map_err(|e| match e {
                            Error::NotFound(_) => Error::NotFound(not_built(&name, &r.id)),
                            other => other,
                        })
                        .and_then(SnapshotSource::app_template)
                        .and_then(|s| {
                            // The template's policy, unless the pod has its own.
                            let own = spec::annotation(r.oci, EGRESS_POLICY_ANNOTATION).is_some();
                            if let (Some(json), Some(setup), false) =
                                (&s.egress_policy, network.as_mut(), own)
                            {
                                setup.plan.policy = twig_net::parse_policy(json, "the label")
                                    .map_err(|e| {
                                        Error::FailedPrecondition(format!(
                                            "SandboxTemplate {name}: its egress policy on this \
                                             node is unusable: {e}"
                                        ))
                                    })?;
                            }
                            Ok(s)
                        }),
                }
            })
            .transpose()?;
        let (mut api, agent) = Self::restore(
            source
                .as_ref()
                .map_or(Path::new(&vm.template_dir), |s| &s.dir),
            source.as_ref().map_or(&[][..], |s| &s.slots),
            Path::new(&vm.api_socket),
            Path::new(&vm.vsock_socket),
            timeout,
        )
        .map_err(|e| with_vm_logs(e, &vm_dir))?;
        let mut slots = vec![false; vm.disk_slots as usize];
        let mut restored = Vec::new();
        // Every restored VM gets its own identity — fresh entropy for the
        // guest's RNG and the host's wall clock (a VM restored from the
        // base template would otherwise run with the template's RNG state,
        // the same in every pod, and its clock, stuck at the template's
        // build), and the pod's hostname (a clone's: its snapshot's) — with
        // the pod's network identity in one Reidentify, or on its own when
        // the pod has no network.
        let identity =
            restore::identity(source.as_ref().map_or(hostname, |s| s.hostname.as_str()))?;
        if network.is_none() {
            agent
                .reidentify(&identity, timeout)
                .map_err(|e| Error::agent("giving the restored VM its own identity", e))?;
        }
        if let Some(source) = source {
            for s in source.slot_numbers() {
                if let Some(used) = slots.get_mut(s) {
                    *used = true;
                }
            }
            tracing::info!(
                snapshot = source.id,
                hostname = source.hostname,
                adopt = source.restored.len(),
                "restored from a pod snapshot"
            );
            restored = source.restored;
        }
        // After every restore (template or pod snapshot), before the first
        // container: the pod's own network identity.
        let pod_net = network
            .as_ref()
            .map(|setup| join_network(setup, state_dir, &mut api, &agent, &identity, timeout))
            .transpose()
            .map_err(|e| with_vm_logs(e, &vm_dir))?;
        tracing::info!(
            sandbox_id,
            pid = vm.pid,
            pooled = vm.pooled,
            template = vm.template_dir,
            memory_mib = vm.memory_mib,
            vcpus = vm.vcpus,
            gate_wait_us = permit.waited.as_micros() as u64,
            gate_slot = permit.slot,
            acquired_us = acquired.as_micros() as u64,
            launch_us = started.elapsed().as_micros() as u64,
            "sandbox VM restored, agent answers"
        );
        let stopping = Arc::new(AtomicBool::new(false));
        let death = match guard
            .0
            .as_ref()
            .map(|p| watch_death(p, stopping.clone(), logs))
        {
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => {
                if let Some(n) = pod_net {
                    drop(guard);
                    if let Err(d) = n.detach() {
                        tracing::warn!("detaching the pod's network: {d}");
                    }
                }
                return Err(e);
            }
            None => None,
        };
        Ok(VmSandbox {
            vmm: Mutex::new(Vmm {
                process: guard.0.take(),
                api,
            }),
            agent: RwLock::new(AgentConn {
                client: agent,
                epoch: 0,
            }),
            vsock: PathBuf::from(&vm.vsock_socket),
            template_dir: PathBuf::from(&vm.template_dir),
            slots: Mutex::new(slots),
            timeout,
            stopping,
            death: Mutex::new(death),
            state_dir: state_dir.to_path_buf(),
            network: Mutex::new(pod_net),
            path: network.map(|setup| PathControl {
                joiner: setup.joiner,
                dir: setup.dir,
                policy: Mutex::new(setup.plan.policy),
            }),
            restored: Mutex::new(restored),
        })
    }

    /// Restores `dir` (a template, or a pod snapshot with the images of
    /// its attached slots, `slots`) into the VMM serving `api_sock` and
    /// waits for its agent on `vsock`.
    fn restore(
        dir: &Path,
        slots: &[(usize, PathBuf, File)],
        api_sock: &Path,
        vsock: &Path,
        timeout: Duration,
    ) -> Result<(Client, AgentClient)> {
        let mut api =
            Client::connect(api_sock, timeout).map_err(vmm_error("connecting to twig-vmm"))?;
        let sent: Vec<(usize, &Path, &File)> = slots
            .iter()
            .map(|(s, name, file)| (*s, name.as_path(), file))
            .collect();
        api.restore_with(dir, &sent, timeout)
            .map_err(vmm_error(format!("restoring {}", dir.display())))?;
        // A connection made while the restored guest is still handling the
        // vsock transport reset that every restore sends is reset with it:
        // retry the handshake and a ping until the agent answers.
        let agent = AgentClient::wait_ready(vsock, twig_agent::AGENT_VSOCK_PORT, timeout)
            .map_err(|e| Error::agent("waiting for the agent of the restored VM", e))?;
        Ok((api, agent))
    }

    fn vmm(&self) -> MutexGuard<'_, Vmm> {
        self.vmm.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take_slot(&self) -> Result<usize> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let free = slots.iter().position(|used| !used).ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "the pod's VM has {} disk slots and all hold a container's rootfs",
                slots.len()
            ))
        })?;
        slots[free] = true;
        Ok(free)
    }

    fn free_slot(&self, slot: usize) {
        if let Some(s) = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(slot)
        {
            *s = false;
        }
    }
}

/// Why a pod of SandboxTemplate `name` (node store id `id`) cannot start
/// when its template is not in the node store.
fn not_built(name: &str, id: &str) -> String {
    format!(
        "{TEMPLATE_ANNOTATION}: SandboxTemplate {name} is not built on this node (node store id \
         {id}): its status says whether the node's build is ready"
    )
}

/// The guest's name for disk slot `slot`: the VM has no fixed disks, so the
/// slots are the first virtio-blk devices in MMIO order.
pub fn slot_device(slot: usize) -> Result<String> {
    u8::try_from(slot)
        .ok()
        .filter(|s| *s < 26)
        .map(|s| format!("/dev/vd{}", char::from(b'a' + s)))
        .ok_or_else(|| Error::InvalidArgument(format!("no guest device name for disk slot {slot}")))
}

/// Asks the node daemon for a prepared VMM for a pod limited to
/// `resources`: of the smallest base template shape that holds them (the
/// daemon adds its guest reserve to the memory limit), or with
/// `restore_from` of that pod snapshot's shape if it holds them (the
/// daemon also keeps the snapshot from being deleted while the VM runs).
/// A pod that fits no shape is `FailedPrecondition` naming what it asked
/// and the largest shape. Without a daemon this is an error naming its
/// socket: there is no fallback.
pub fn acquire(
    config: &Config,
    sandbox_id: &str,
    restore_from: Option<&str>,
    resources: spec::PodResources,
) -> Result<AcquireVmResponse> {
    let socket = &config.node_socket;
    let client = ttrpc::Client::connect(&format!("unix://{}", socket.display())).map_err(|e| {
        Error::FailedPrecondition(format!(
            "the node daemon does not answer on {} ({e}): is twig-node running?",
            socket.display()
        ))
    })?;
    let req = AcquireVmRequest {
        sandbox_id: sandbox_id.to_string(),
        // The daemon kills the VM if this shim dies, at any moment.
        owner_pid: std::process::id(),
        restore_from: restore_from.unwrap_or_default().to_string(),
        memory_limit_bytes: resources.memory_limit_bytes,
        cpu_limit_millis: resources.cpu_limit_millis,
        ..Default::default()
    };
    let timeout = Duration::from_secs(config.acquire_timeout_s);
    let ctx = ttrpc::context::with_timeout(i64::try_from(timeout.as_nanos()).unwrap_or(i64::MAX));
    PoolClient::new(client).acquire_vm(ctx, &req).map_err(|e| {
        let what = format!(
            "getting a VM{} from the node daemon at {}",
            restore_from
                .map(|id| format!(" to restore snapshot {id:?} into"))
                .unwrap_or_default(),
            socket.display()
        );
        match e {
            ttrpc::Error::RpcStatus(s) => {
                let msg = format!("{what}: {}", s.message());
                match s.code() {
                    ttrpc::Code::INVALID_ARGUMENT => Error::InvalidArgument(msg),
                    ttrpc::Code::NOT_FOUND => Error::NotFound(msg),
                    ttrpc::Code::FAILED_PRECONDITION => Error::FailedPrecondition(msg),
                    ttrpc::Code::UNIMPLEMENTED => Error::Unimplemented(msg),
                    _ => Error::Internal(msg),
                }
            }
            other => Error::Internal(format!("{what}: {other}")),
        }
    })
}

/// A VMM the node daemon handed over: not this process's child (the daemon
/// reaps it), so it is watched and signalled through a pidfd.
struct Process {
    pid: u32,
    pidfd: OwnedFd,
}

impl Process {
    /// A pidfd for `pid`, once `/proc/<pid>/cmdline` shows it serves
    /// `api_socket` (so a recycled pid is never signalled).
    fn open(pid: u32, api_socket: &str) -> Result<Process> {
        let raw = libc::pid_t::try_from(pid)
            .map_err(|_| Error::Internal(format!("the node daemon handed over pid {pid}")))?;
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new
        // descriptor or -1; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
        if fd < 0 {
            return Err(Error::io(
                format!("pidfd_open of the handed-over twig-vmm {pid}"),
                std::io::Error::last_os_error(),
            ));
        }
        let fd =
            i32::try_from(fd).map_err(|_| Error::Internal(format!("pidfd_open returned {fd}")))?;
        // SAFETY: `fd` is a descriptor pidfd_open just returned, owned by
        // nothing else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(api_socket) {
            return Err(Error::Internal(format!(
                "pid {pid} handed over by the node daemon is not the twig-vmm serving {api_socket}"
            )));
        }
        Ok(Process { pid, pidfd })
    }

    fn kill(&self) {
        // SAFETY: pidfd_send_signal(2) on our pidfd, no siginfo; no memory
        // is passed.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc != 0 {
            tracing::debug!(
                pid = self.pid,
                "pidfd_send_signal: {}",
                std::io::Error::last_os_error()
            );
        }
    }

    /// Whether the process exited within `timeout`.
    fn wait(&self, timeout: Duration) -> bool {
        wait_exit(&self.pidfd, Some(timeout))
    }
}

/// Whether the process of `pidfd` exited within `timeout` (`None`: waits
/// as long as it takes). A pidfd polls readable once its process exited.
fn wait_exit(pidfd: &OwnedFd, timeout: Option<Duration>) -> bool {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                i32::try_from(left.as_millis()).unwrap_or(i32::MAX)
            }
            None => -1,
        };
        // SAFETY: one pollfd we own, for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc > 0 {
            return true;
        }
        if rc == 0 || deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        // EINTR: poll again until the deadline.
    }
}

/// The file in the shim's state directory naming the pod's VMM: its pid on
/// the first line, its API socket on the second.
pub const PID_FILE: &str = "vmm.pid";

/// The VMM's log and guest console, opened while they exist: read after a
/// death, when twig-node may have removed them already.
struct VmLogs {
    vmm: Option<File>,
    console: Option<File>,
}

impl VmLogs {
    fn open(vm_dir: &Path) -> VmLogs {
        VmLogs {
            vmm: File::open(vm_dir.join("vmm.log")).ok(),
            console: File::open(vm_dir.join("serial.log")).ok(),
        }
    }

    /// `[twig-vmm log: …] [guest console: …]`, the last lines of each.
    fn tails(&mut self) -> String {
        let tail = |f: &mut Option<File>| {
            let mut text = Vec::new();
            if let Some(f) = f {
                if f.rewind().and_then(|()| f.read_to_end(&mut text)).is_err() {
                    return "(unreadable)".to_string();
                }
            }
            tail_lines(&String::from_utf8_lossy(&text))
        };
        format!(
            "[twig-vmm log: {}] [guest console: {}]",
            tail(&mut self.vmm),
            tail(&mut self.console)
        )
    }
}

/// The last [`LOG_TAIL_LINES`] lines of `text`, joined with ` | `.
fn tail_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join(" | ")
}

/// A thread waiting on (a duplicate of) the VMM's pidfd: when the process
/// ends while `stopping` is unset, the receiver gets why, at once (the
/// shim does not wait for its next call to the VM to notice).
fn watch_death(process: &Process, stopping: Arc<AtomicBool>, mut logs: VmLogs) -> Result<Death> {
    let pidfd = process
        .pidfd
        .try_clone()
        .map_err(|e| Error::io("duplicating the VMM's pidfd", e))?;
    let pid = process.pid;
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("vmm-watch".into())
        .spawn(move || {
            wait_exit(&pidfd, None);
            if stopping.load(Ordering::SeqCst) {
                return;
            }
            // The VMM is twig-node's child: its exit status is the
            // daemon's to read (and log), not the shim's.
            let why = format!(
                "twig-vmm (pid {pid}) exited without being stopped (its exit status is in \
                 twig-node's log, which reaped it) {}",
                logs.tails()
            );
            if tx.send(why).is_err() {
                tracing::warn!(pid, "the pod's VMM died and nobody watches the sandbox");
            }
        })
        .map_err(|e| Error::io("starting the VMM watch thread", e))?;
    Ok(rx)
}

/// Kills the VMM, and removes the state directory naming it, if the start
/// fails half-way.
struct KillOnDrop(Option<Process>, PathBuf);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            p.kill();
            if !p.wait(Duration::from_secs(5)) {
                tracing::warn!(pid = p.pid, "the killed twig-vmm did not exit within 5 s");
            }
            if let Err(e) = std::fs::remove_dir_all(&self.1) {
                tracing::warn!("removing {}: {e}", self.1.display());
            }
        }
    }
}

impl Sandbox for VmSandbox {
    fn agent(&self) -> AgentClient {
        self.agent
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .client
            .clone()
    }

    fn agent_epoch(&self) -> u64 {
        self.agent.read().unwrap_or_else(|p| p.into_inner()).epoch
    }

    fn snapshot_store(&self) -> Result<PathBuf> {
        twig_store::layout::locate(&self.template_dir)
            .map(|(root, _)| root)
            .map_err(|e| {
                Error::FailedPrecondition(format!(
                    "the pod's template is not in a node store, so its snapshots have none: {e}"
                ))
            })
    }

    fn create_container(
        &self,
        id: &str,
        image: &Path,
        read_only: bool,
        spec_json: &[u8],
    ) -> Result<Attachment> {
        let slot = self.take_slot()?;
        let attachment = Attachment {
            device: slot_device(slot)?,
            slot: Some(slot),
        };
        if let Err(e) = self
            .vmm()
            .api
            .attach_disk(slot, image, read_only, self.timeout)
        {
            self.free_slot(slot);
            return Err(vmm_error(format!(
                "attaching {} to disk slot {slot}",
                image.display()
            ))(e));
        }
        // The guest sees the new capacity once it handled the slot's
        // configuration-change interrupt: the agent waits for it.
        let created = std::fs::metadata(image)
            .map_err(|e| Error::io(format!("reading the size of {}", image.display()), e))
            .and_then(|meta| {
                self.agent()
                    .create_container_on_new_disk(
                        id,
                        &attachment.device,
                        read_only,
                        meta.len(),
                        spec_json,
                        self.timeout,
                    )
                    .map_err(|e| {
                        Error::agent(
                            format!("creating container {id} on {}", attachment.device),
                            e,
                        )
                    })
            });
        if let Err(e) = created {
            if let Err(d) = self.detach(&attachment) {
                tracing::warn!(slot, "detaching after a failed create: {d}");
            }
            return Err(e);
        }
        Ok(attachment)
    }

    fn detach(&self, attachment: &Attachment) -> Result<()> {
        let Some(slot) = attachment.slot else {
            return Ok(());
        };
        self.vmm()
            .api
            .detach_disk(slot, self.timeout)
            .map_err(vmm_error(format!("detaching disk slot {slot}")))?;
        self.free_slot(slot);
        Ok(())
    }

    fn pause(&self) -> Result<()> {
        self.vmm()
            .api
            .pause(self.timeout)
            .map(|_| ())
            .map_err(vmm_error("pausing the VM"))
    }

    fn resume(&self) -> Result<()> {
        self.vmm()
            .api
            .resume(self.timeout)
            .map(|_| ())
            .map_err(vmm_error("resuming the VM"))
    }

    fn shutdown(&self) -> Result<()> {
        self.stopping.store(true, Ordering::SeqCst);
        let mut vmm = self.vmm();
        let Some(process) = vmm.process.take() else {
            return Ok(());
        };
        let exited = if process.wait(Duration::ZERO) {
            true
        } else {
            match vmm.api.shutdown(self.timeout) {
                Ok(()) if process.wait(self.timeout) => true,
                Ok(()) => {
                    tracing::warn!("twig-vmm did not exit after its shutdown; killing it");
                    false
                }
                Err(e) => {
                    tracing::warn!("twig-vmm did not shut down on request ({e}); killing it");
                    false
                }
            }
        };
        if !exited {
            process.kill();
            if !process.wait(self.timeout) {
                return Err(Error::Internal(format!(
                    "twig-vmm {} did not exit within {:?} of SIGKILL",
                    process.pid, self.timeout
                )));
            }
        }
        // The VMM held the tap's last descriptor: the tap is gone; the
        // programs and pins go now. If that fails the state directory (and
        // its record) stays, for `delete` to try again.
        let network = self
            .network
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(n) = network {
            n.detach()?;
        }
        if let Err(e) = std::fs::remove_dir_all(&self.state_dir) {
            tracing::warn!("removing {}: {e}", self.state_dir.display());
        }
        Ok(())
    }

    fn kill(&self) -> Result<()> {
        match self.vmm().process.as_ref() {
            Some(p) => {
                tracing::warn!(pid = p.pid, "killing the pod's twig-vmm");
                p.kill();
                Ok(())
            }
            None => Err(Error::FailedPrecondition(
                "the pod's VM is already stopped".into(),
            )),
        }
    }

    fn death(&self) -> Option<Death> {
        self.death.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn snapshot(&self, staging: &Path, full: bool) -> Result<VmSnapshot> {
        let kind = if full {
            twig_vmm::Kind::Full
        } else {
            twig_vmm::Kind::Incremental
        };
        let info = self
            .vmm()
            .api
            .snapshot(staging, kind, self.timeout.max(SLOW_CALL))
            .map_err(vmm_error(format!(
                "snapshotting the VM into {}",
                staging.display()
            )))?;
        Ok(VmSnapshot {
            parent: info.parent,
            pages_written: u64::try_from(info.pages_written).unwrap_or(u64::MAX),
        })
    }

    fn rollback(&self, dir: &Path) -> Result<VmRollback> {
        // Agent calls wait while the guest goes back and the connection is
        // replaced; calls that failed on the dropped one see a new epoch.
        let mut agent = self.agent.write().unwrap_or_else(|p| p.into_inner());
        let result = self
            .vmm()
            .api
            .rollback(dir, self.timeout.max(SLOW_CALL))
            .map_err(vmm_error(format!(
                "rolling the VM back to {}",
                dir.display()
            )));
        let result = match result {
            Err(e) if e.is_vm_lost() => return Err(e),
            other => other,
        };
        // The VMM drops host vsock connections when the guest's state goes
        // back (a refusal may have undone that far too): keep the
        // connection only if it still answers.
        if agent.client.ping(PING_AFTER_ROLLBACK).is_err() {
            let client =
                AgentClient::wait_ready(&self.vsock, twig_agent::AGENT_VSOCK_PORT, self.timeout)
                    .map_err(|e| Error::agent("reconnecting to the agent after a rollback", e))?;
            agent.client = client;
            agent.epoch += 1;
        }
        let info = result?;
        // The rolled-back guest has its snapshot's RNG state and clock
        // (and, from a clone's snapshot, another pod's network identity):
        // fresh entropy, the host's clock and this pod's network again.
        let own = restore::identity("")?;
        let network = self
            .network
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|n| n.identity().clone())
            .unwrap_or_default();
        agent
            .client
            .reidentify(
                &ReidentifyRequest {
                    entropy: own.entropy,
                    realtime_ns: own.realtime_ns,
                    ..network
                },
                self.timeout,
            )
            .map_err(|e| Error::agent("giving the rolled-back guest its own identity", e))?;
        Ok(VmRollback {
            pages_restored: u64::try_from(info.pages_restored).unwrap_or(u64::MAX),
            remapped: info.remapped,
        })
    }

    fn network_stats(&self) -> Result<Option<NetworkStats>> {
        let Some(path) = &self.path else {
            return Ok(None);
        };
        let policy = path
            .policy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Ok(Some(NetworkStats {
            policy,
            counters: path.joiner.counters(&path.dir)?,
        }))
    }

    fn set_egress_policy(&self, policy: &EgressPolicy) -> Result<()> {
        let path = self.path.as_ref().ok_or_else(|| {
            Error::FailedPrecondition("the pod has no network path (no network namespace)".into())
        })?;
        let mut current = path.policy.lock().unwrap_or_else(|p| p.into_inner());
        path.joiner.set_policy(&path.dir, policy)?;
        *current = policy.clone();
        tracing::info!(dir = %path.dir.display(), "the pod's egress policy was replaced");
        Ok(())
    }

    fn take_restored(&self, name: &str) -> Option<Restored> {
        let mut restored = self.restored.lock().unwrap_or_else(|p| p.into_inner());
        let i = restored.iter().position(|r| r.name == name).or_else(|| {
            // An app template's container goes to the pod's first one.
            (name != SANDBOX_ADOPTION)
                .then(|| restored.iter().position(|r| r.name == TEMPLATE_ADOPTION))
                .flatten()
        })?;
        Some(restored.remove(i))
    }
}

impl Drop for VmSandbox {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!("stopping the VM: {e}");
        }
    }
}

/// Lines of each log a failed VM start quotes.
const LOG_TAIL_LINES: usize = 12;

/// `e` with the end of the VMM's log and of the guest's console appended,
/// so the error containerd shows says why the VM did not come up (the state
/// directory holding the logs goes with the failed task).
fn with_vm_logs(e: Error, state_dir: &Path) -> Error {
    let tail = |name: &str| {
        let text = std::fs::read(state_dir.join(name)).unwrap_or_default();
        tail_lines(&String::from_utf8_lossy(&text))
    };
    let logs = format!(
        " [twig-vmm log: {}] [guest console: {}]",
        tail("vmm.log"),
        tail("serial.log")
    );
    match e {
        Error::Agent { what, source } => Error::Agent {
            what: what + &logs,
            source,
        },
        Error::Vmm { what, source } => Error::Vmm {
            what: what + &logs,
            source,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_first_virtio_disks() {
        assert_eq!(slot_device(0).unwrap(), "/dev/vda");
        assert_eq!(slot_device(2).unwrap(), "/dev/vdc");
        assert!(slot_device(26).is_err());
    }

    #[test]
    fn a_handed_over_process_is_watched_and_killed_through_its_pidfd() {
        let mut child = sleep("1000");
        let e = Process::open(child.id(), "/not/its/api.sock")
            .err()
            .unwrap();
        assert!(e.to_string().contains("is not the twig-vmm serving"), "{e}");
        let p = Process::open(child.id(), "1000").unwrap();
        assert!(!p.wait(Duration::from_millis(20)), "sleep runs");
        p.kill();
        assert!(p.wait(Duration::from_secs(5)), "killed");
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
    }

    /// `sleep arg`, once its command line shows `arg` (exec'd).
    fn sleep(arg: &str) -> std::process::Child {
        let child = std::process::Command::new("sleep")
            .arg(arg)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read(format!("/proc/{}/cmdline", child.id()))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(arg))
        {
            assert!(Instant::now() < deadline, "sleep {arg} did not start");
            std::thread::sleep(Duration::from_millis(1));
        }
        child
    }

    #[test]
    fn a_vmm_that_dies_unasked_is_reported_at_once_with_its_logs() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("vmm.log"), "line 1\nvmm: last words\n").unwrap();
        let mut child = sleep("1001");
        let p = Process::open(child.id(), "1001").unwrap();
        let logs = VmLogs::open(dir.path());
        // twig-node removes the VMM's directory once it reaped it.
        drop(dir);
        let mut death = watch_death(&p, Arc::new(AtomicBool::new(false)), logs).unwrap();
        assert!(death.try_recv().is_err(), "reported while it runs");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        child.wait().unwrap();
        let why = death.blocking_recv().expect("the death is reported");
        assert!(
            why.contains(&format!("pid {}", child.id())) && why.contains("vmm: last words"),
            "{why}"
        );
    }

    #[test]
    fn a_vmm_stopped_on_purpose_is_no_death() {
        let mut child = sleep("1002");
        let p = Process::open(child.id(), "1002").unwrap();
        let stopping = Arc::new(AtomicBool::new(false));
        let death = watch_death(
            &p,
            stopping.clone(),
            VmLogs {
                vmm: None,
                console: None,
            },
        )
        .unwrap();
        stopping.store(true, Ordering::SeqCst);
        p.kill();
        child.wait().unwrap();
        assert!(death.blocking_recv().is_err(), "a shutdown is not a death");
    }

    #[test]
    fn without_a_node_daemon_the_error_names_its_socket() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            node_socket: dir.path().join("node.sock"),
            ..Config::default()
        };
        let e = acquire(&config, "sb", None, Default::default()).unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
        assert!(
            e.to_string()
                .contains(&*config.node_socket.to_string_lossy())
                && e.to_string().contains("twig-node"),
            "{e}"
        );
    }
}
