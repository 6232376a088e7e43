//! Making a pod's [`VmSandbox`], one step at a time: take a prepared VMM
//! from the node daemon's pool, hold it and move it into the pod's cgroup,
//! find the snapshot to restore from
//! (if any), restore, give the VM its own identity, hand the snapshot's
//! running containers over for adoption, join the pod's network, and watch
//! the VMM for its death.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use containerd_shim_protos::ttrpc;
use twig_agent::client::AgentClient;
use twig_agent::proto::agent::{self as agent_proto, ReidentifyRequest};
use twig_net::EGRESS_POLICY_ANNOTATION;
use twig_proto::contract::EnvdPolicy;
use twig_proto::node::{AcquireVmRequest, AcquireVmResponse};
use twig_proto::node_ttrpc::PoolClient;
use twig_vmm::api::Client;

use super::vmm::{watch_death, with_vm_logs, KillOnDrop, Process, VmLogs, PID_FILE};
use super::{vmm_error, AgentConn, PathControl, VmSandbox, Vmm};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::gate::StartGate;
use crate::resources::cgroups;
use crate::resources::limits::{self, PodResources};
use crate::resources::network::{self, Joiner, PodNet};
use crate::resources::port_forward::PortForwarder;
use crate::resources::rootfs::DiskSlots;
use crate::restore::{
    self, not_built, restore_source, RestoreFrom, SnapshotSource, RESTORE_FROM_ANNOTATION,
};
use crate::sandbox::{Launcher, Restored, Sandbox, VmShape};
use crate::spec;

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
        spec::check_host_namespaces(&spec)?;
        let restore_from = restore_source(&spec, rootfs)?;
        // The pod's limits choose its VM's shape (the node daemon's
        // smallest that fits); bad values fail here, before a VM is taken.
        let resources = limits::pod_resources(&spec)?;
        // The cgroup kubelet gives the sandbox, where the VM is charged.
        let cgroup = cgroups::sandbox_cgroup(&spec)?;
        let envd = spec::envd(&spec)?;
        // The policy is checked before a VM is taken; a kernel that cannot
        // filter the pod's network refuses it at the join, never runs it
        // unfiltered.
        let bound = self.config.egress_bound.clone().unwrap_or_default();
        let network = match network::plan(&spec, &bound)? {
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
            envd,
            restore_from,
            network,
            resources,
            cgroup.as_deref(),
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

/// Step 7, the pod's network: the hook every restore of a pod's VM runs
/// before the first container starts: creates the pod's tap, joins it to the pod's veth, sends it to
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
                envd: own.envd.clone(),
                ..network.clone()
            };
            agent
                .reidentify(&request, timeout)
                .map(|_| ())
                .map_err(|e| Error::agent("giving the guest the pod's network identity", e))
        },
    )
}

impl VmSandbox {
    /// Takes a prepared VMM from the node daemon (`config.node_socket`) of
    /// the shape that fits `resources` (the daemon chooses; a pod that
    /// fits none is refused before any VM is taken), restores the node's
    /// base template of that shape into it — or, with
    /// `restore_from`, that pod snapshot (or app template) of the
    /// template's store, then gives the clone its own identity — and
    /// connects to its agent. With `cgroup` (the sandbox's, from
    /// [`cgroups::sandbox_cgroup`]) the VMM runs in it from before the
    /// restore on. On failure the VMM is killed.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        config: &Config,
        state_dir: &Path,
        sandbox_id: &str,
        hostname: &str,
        envd: Option<EnvdPolicy>,
        restore_from: Option<RestoreFrom<'_>>,
        mut network: Option<NetworkSetup>,
        resources: PodResources,
        cgroup: Option<&Path>,
    ) -> Result<VmSandbox> {
        std::fs::create_dir_all(state_dir)
            .map_err(|e| Error::io(format!("creating {}", state_dir.display()), e))?;
        // A few starts of the node at a time (crate::gate), this one's
        // slot held until its VM answers or it failed.
        let permit = StartGate::new(&config.state_root, config.start_concurrency)
            .enter(Duration::from_secs(config.acquire_timeout_s))?;
        let started = Instant::now();
        let vm = acquire_from_pool(config, sandbox_id, restore_from.as_ref(), resources)?;
        let acquired = started.elapsed();
        let mut guard = hold_vmm(&vm, state_dir)?;
        // Before the restore: the guest's memory is charged to the cgroup
        // of the task that faults it in.
        let placed = Instant::now();
        if let Some(cg) = cgroup {
            cgroups::join(cg, vm.pid)?;
        }
        let placed = placed.elapsed();
        let timeout = Duration::from_secs(config.call_timeout_s);
        let vm_dir = PathBuf::from(&vm.state_dir);
        // Opened now: twig-node removes the VMM's directory once it reaped
        // it, and a death is explained with what these files say.
        let logs = VmLogs::open(&vm_dir);
        // Pulled lazily: the node serves its memory as it arrives.
        let lazy = Some(Path::new(&vm.lazy_socket)).filter(|p| !p.as_os_str().is_empty());
        let source = restore_from
            .map(|mut r| {
                // Pulled from its artifact: the node's id for it.
                if !vm.restored_id.is_empty() {
                    r.id.clone_from(&vm.restored_id);
                }
                open_snapshot(
                    r,
                    Path::new(&vm.template_dir),
                    lazy.is_some(),
                    sandbox_id,
                    network.as_mut(),
                )
            })
            .transpose()?;
        let (mut api, agent) = restore(
            source
                .as_ref()
                .map_or(Path::new(&vm.template_dir), |s| &s.dir),
            source.as_ref().map_or(&[][..], |s| &s.slots),
            lazy,
            Path::new(&vm.api_socket),
            Path::new(&vm.vsock_socket),
            timeout,
        )
        .map_err(|e| with_vm_logs(e, &vm_dir))?;
        let slots = DiskSlots::new(vm.disk_slots as usize);
        let identity = reidentify(
            &agent,
            source.as_ref().map_or(hostname, |s| s.hostname.as_str()),
            envd,
            network.is_some(),
            timeout,
        )?;
        let restored = source.map(|s| to_adopt(s, &slots)).unwrap_or_default();
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
            cgroup = ?cgroup,
            cgroup_us = placed.as_micros() as u64,
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
            template_dir: match lazy {
                // Where the staged snapshot is published once its memory
                // has arrived: the store of the pod's snapshots.
                Some(_) => twig_store::layout::staging_target(Path::new(&vm.template_dir))
                    .map(|(_, published)| published)
                    .unwrap_or_else(|_| PathBuf::from(&vm.template_dir)),
                None => PathBuf::from(&vm.template_dir),
            },
            slots,
            shape: VmShape {
                memory_bytes: u64::from(vm.memory_mib) << 20,
                vcpus: vm.vcpus,
            },
            timeout,
            stopping,
            death: Mutex::new(death),
            state_dir: state_dir.to_path_buf(),
            cgroup: cgroup.map(Path::to_path_buf),
            network: Mutex::new(pod_net),
            port_forward: network.as_ref().map(|setup| {
                PortForwarder::start(
                    setup.plan.netns.clone(),
                    PathBuf::from(&vm.vsock_socket),
                    timeout,
                )
            }),
            path: network.map(|setup| PathControl {
                joiner: setup.joiner,
                dir: setup.dir,
                policy: Mutex::new(setup.plan.policy),
            }),
            restored: Mutex::new(restored),
        })
    }
}

/// Step 1, the pool: [`acquire`]s a VMM for the pod. The daemon reads a
/// restore-from snapshot's shape before it hands over a VM: one that is not
/// there is refused (`NotFound`, naming the annotation, or for an app
/// template saying it is not built) before any is taken.
fn acquire_from_pool(
    config: &Config,
    sandbox_id: &str,
    restore_from: Option<&RestoreFrom<'_>>,
    resources: PodResources,
) -> Result<AcquireVmResponse> {
    acquire(
        config,
        sandbox_id,
        restore_from.map(|r| r.id.as_str()),
        restore_from.and_then(|r| r.artifact.as_ref()),
        resources,
    )
    .map_err(|e| match (e, restore_from) {
        (Error::NotFound(m), Some(r)) => Error::NotFound(match &r.app_template {
            Some(name) => not_built(name, &r.id),
            None => format!("{RESTORE_FROM_ANNOTATION}: {m}"),
        }),
        (e, _) => e,
    })
}

/// Step 2, ownership: a pidfd on the handed-over VMM, which kills it (and
/// removes `state_dir`) unless the start completes, and the record in
/// `state_dir` that `delete` finds it by after a crash of this shim: the
/// pid, and the API socket its command line must name.
fn hold_vmm(vm: &AcquireVmResponse, state_dir: &Path) -> Result<KillOnDrop> {
    let process = Process::open(vm.pid, &vm.api_socket)?;
    let guard = KillOnDrop(Some(process), state_dir.to_path_buf());
    std::fs::write(
        state_dir.join(PID_FILE),
        format!("{}\n{}\n", vm.pid, vm.api_socket),
    )
    .map_err(|e| Error::io(format!("writing {}/{PID_FILE}", state_dir.display()), e))?;
    Ok(guard)
}

/// Step 3, restore-from: the pod snapshot `r` names, found in the node
/// store holding `template_dir` ([`SnapshotSource::open`]). An app
/// template's running container goes to the pod's first one, and its
/// egress policy becomes the pod's `network` policy unless the pod has its
/// own.
fn open_snapshot(
    r: RestoreFrom<'_>,
    template_dir: &Path,
    staged: bool,
    sandbox_id: &str,
    network: Option<&mut NetworkSetup>,
) -> Result<SnapshotSource> {
    let source = if staged {
        SnapshotSource::open_staged(template_dir, &r.id, r.oci, sandbox_id, r.rootfs)
    } else {
        SnapshotSource::open(template_dir, &r.id, r.oci, sandbox_id, r.rootfs)
    };
    match r.app_template {
        None => source,
        Some(name) => source
            .map_err(|e| match e {
                Error::NotFound(_) => Error::NotFound(not_built(&name, &r.id)),
                other => other,
            })
            .and_then(SnapshotSource::app_template)
            .and_then(|s| {
                // The template's policy; a pod's own narrows it, never
                // widens it.
                let Some(setup) = network else { return Ok(s) };
                let template = match &s.egress_policy {
                    Some(json) => twig_net::parse_policy(json, "the label").map_err(|e| {
                        Error::FailedPrecondition(format!(
                            "SandboxTemplate {name}: its egress policy on this \
                                 node is unusable: {e}"
                        ))
                    })?,
                    None => twig_net::EgressPolicy::default(),
                };
                setup.plan.policy = if spec::annotation(r.oci, EGRESS_POLICY_ANNOTATION).is_some() {
                    network::bounded(
                        &setup.plan.policy,
                        &template,
                        &format!("SandboxTemplate {name}'s spec.egressPolicy"),
                    )?
                } else {
                    template
                };
                Ok(s)
            }),
    }
}

/// Step 4, the restore: `dir` (a template, or a pod snapshot with the
/// images of its attached slots, `slots`) into the VMM serving `api_sock`
/// — with `lazy`, its memory from the node's page server listening there
/// (userfaultfd) —; then waits for its agent on `vsock`.
fn restore(
    dir: &Path,
    slots: &[(usize, PathBuf, File)],
    lazy: Option<&Path>,
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
    let restored = match lazy {
        None => api.restore_with(dir, &sent, timeout),
        Some(socket) => {
            let (uffd, server) = lazy_channel(socket)?;
            api.restore_lazy(dir, &sent, &uffd, &server, timeout)
        }
    };
    restored.map_err(vmm_error(format!("restoring {}", dir.display())))?;
    // A connection made while the restored guest is still handling the
    // vsock transport reset that every restore sends is reset with it:
    // retry the handshake and a ping until the agent answers.
    let agent = AgentClient::wait_ready(vsock, twig_agent::AGENT_VSOCK_PORT, timeout)
        .map_err(|e| Error::agent("waiting for the agent of the restored VM", e))?;
    Ok((api, agent))
}

/// What a lazy restore sends twig-vmm: `/dev/userfaultfd` (its user
/// cannot open it; with it the VMM makes a userfaultfd of its own guest
/// memory) and a connection to the node's page server at `socket`.
fn lazy_channel(socket: &Path) -> Result<(File, std::os::unix::net::UnixStream)> {
    let uffd = File::options()
        .read(true)
        .write(true)
        .open(USERFAULTFD_DEVICE)
        .map_err(|e| {
            Error::FailedPrecondition(format!(
                "a lazy restore needs {USERFAULTFD_DEVICE} (Linux 6.1 or later): {e}"
            ))
        })?;
    let server = std::os::unix::net::UnixStream::connect(socket).map_err(|e| {
        Error::io(
            format!("connecting to the node's page server {}", socket.display()),
            e,
        )
    })?;
    Ok((uffd, server))
}

const USERFAULTFD_DEVICE: &str = "/dev/userfaultfd";

/// Step 5, the VM's own identity. Every restored VM gets one — fresh
/// entropy for the guest's RNG and the host's wall clock (a VM restored
/// from the base template would otherwise run with the template's RNG
/// state, the same in every pod, and its clock, stuck at the template's
/// build), the pod's `hostname` (a clone's: its snapshot's) and its envd
/// ([`envd_of`]) — with the pod's network identity in one Reidentify
/// ([`join_network`]) when `with_network`, or here on its own when the pod
/// has no network.
fn reidentify(
    agent: &AgentClient,
    hostname: &str,
    envd: Option<EnvdPolicy>,
    with_network: bool,
    timeout: Duration,
) -> Result<ReidentifyRequest> {
    let mut identity = restore::identity(hostname)?;
    identity.envd = Some(envd_of(envd)).into();
    if !with_network {
        agent
            .reidentify(&identity, timeout)
            .map_err(|e| Error::agent("giving the restored VM its own identity", e))?;
    }
    Ok(identity)
}

/// What the agent is told of the pod's sandbox API: a VM restored from a
/// pod's snapshot runs that pod's sandbox container, whose envd (in guest
/// memory) is made this pod's.
fn envd_of(policy: Option<EnvdPolicy>) -> agent_proto::EnvdPolicy {
    agent_proto::EnvdPolicy {
        on: policy.is_some(),
        token_sha256: policy
            .and_then(|p| p.token_sha256)
            .map(Vec::from)
            .unwrap_or_default(),
        ..Default::default()
    }
}

/// Step 6, adoption: the restored snapshot's disk slots are taken, and its
/// running containers wait for the pod's containers to adopt them.
fn to_adopt(source: SnapshotSource, slots: &DiskSlots) -> Vec<Restored> {
    slots.mark_used(source.slot_numbers());
    tracing::info!(
        snapshot = source.id,
        hostname = source.hostname,
        adopt = source.restored.len(),
        "restored from a pod snapshot"
    );
    source.restored
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
    artifact: Option<&(String, String)>,
    resources: PodResources,
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
        restore_artifact: artifact.map(|a| a.0.clone()).unwrap_or_default(),
        namespace: artifact.map(|a| a.1.clone()).unwrap_or_default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_node_daemon_the_error_names_its_socket() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            node_socket: dir.path().join("node.sock"),
            ..Config::default()
        };
        let e = acquire(&config, "sb", None, None, Default::default()).unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
        assert!(
            e.to_string()
                .contains(&*config.node_socket.to_string_lossy())
                && e.to_string().contains("twig-node"),
            "{e}"
        );
    }
}
