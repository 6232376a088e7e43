//! The seam where the VM is: a [`Sandbox`] runs one pod's containers
//! through a twig-agent. [`crate::vm::VmSandbox`] is the real one (a
//! twig-vmm process restored from the template); [`HostSandbox`] drives an
//! agent running on the host (`twig-agent --listen unix://…`) with loop
//! devices in place of disk slots, so the Task service is tested against a
//! real agent on a machine where Linux guests do not run.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use twig_agent::client::{AgentClient, ContainerDisks, Error as AgentError};
use twig_agent::proto::agent::BlockVolume;
use twig_net::{Counters, EgressPolicy};

use crate::error::{Error, Result};

/// A container's rootfs as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// The block device the agent mounts (`/dev/vdc`, `/dev/loop3`).
    pub device: String,
    /// The VM's disk slot, if it is one.
    pub slot: Option<usize>,
}

/// The size of a pod's VM: what its containers' limits can grow to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmShape {
    /// Guest memory, bytes.
    pub memory_bytes: u64,
    /// vCPUs.
    pub vcpus: u32,
}

/// What a VM snapshot wrote into its staging directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSnapshot {
    /// The parent of an incremental snapshot (the VM's baseline).
    pub parent: Option<String>,
    /// Guest pages written to its memory file.
    pub pages_written: u64,
}

/// What an in-place rollback did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmRollback {
    /// Guest pages put back.
    pub pages_restored: u64,
    /// Whether all of guest RAM was remapped.
    pub remapped: bool,
}

/// The name under which a restored pod's sandbox container waits to be
/// adopted by the new pod's sandbox container (CRI gives it no container
/// name; no container name can be empty).
pub const SANDBOX_ADOPTION: &str = "";

/// The name under which an app template's running container waits to be
/// adopted by the first container CRI creates in a pod restored from the
/// template (whatever its name: no container name can contain `/`).
pub const TEMPLATE_ADOPTION: &str = "/template";

/// A container that runs in a VM restored from a pod snapshot, waiting to
/// be adopted by the container CRI creates under its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// The id the guest's agent knows it by (its id in the snapshotted pod).
    pub guest_id: String,
    /// Its name in the pod (CRI's `io.kubernetes.cri.container-name`), or
    /// [`SANDBOX_ADOPTION`] for the pod's sandbox container.
    pub name: String,
    /// The disk slot holding its rootfs (the snapshot's copy); none for
    /// the sandbox container (the agent's built-in pause).
    pub slot: Option<usize>,
    /// Its init's pid in the VM, where the snapshot recorded it (the
    /// sandbox's: the pod's namespaces that later containers join).
    pub pid: Option<u32>,
    /// The container name its running processes' guest volumes are named
    /// after, where it is not its adopter's (an app template's build
    /// container's, `template`).
    pub mounts_of: Option<String>,
}

/// One pod's VM (or its stand-in): an agent, and a way to give it a disk.
/// Calls block; the service runs them on blocking threads.
pub trait Sandbox: Send + Sync {
    /// The agent that runs the containers, on its current connection.
    /// A rollback replaces the connection (the VMM drops every host vsock
    /// connection when the guest's state goes back); while one runs, this
    /// call waits for it.
    fn agent(&self) -> AgentClient;
    /// How many times the agent connection was replaced; waits for a
    /// rollback in progress. A call that failed on an older connection is
    /// worth repeating on the current one.
    fn agent_epoch(&self) -> u64;
    /// Hands the block image `image` to the guest and creates container
    /// `id` on it with `spec_json` and its raw block volumes (attached
    /// already, see [`Sandbox::attach_disk`]); on failure the rootfs does
    /// not stay attached.
    fn create_container(
        &self,
        id: &str,
        image: &Path,
        read_only: bool,
        block_volumes: Vec<BlockVolume>,
        spec_json: &[u8],
    ) -> Result<Attachment>;
    /// Hands the block image or host block device `image` to the guest
    /// without a container on it: the pod's disk (its sandbox container's
    /// rootfs image), which holds its disk-backed volumes, or a raw block
    /// volume.
    fn attach_disk(&self, image: &Path, read_only: bool) -> Result<Attachment>;
    /// The VM's shape; `None` without a VM (the host's).
    fn shape(&self) -> Option<VmShape> {
        None
    }
    /// Creates the pod's sandbox container `id` from `spec_json` without a
    /// disk: its init is the agent's built-in pause, which holds the pod's
    /// namespaces (the pause image's rootfs is never needed in a VM).
    fn create_pause(&self, id: &str, spec_json: &[u8], timeout: Duration) -> Result<Attachment> {
        self.agent()
            .create_pause(id, spec_json, timeout)
            .map_err(|e| Error::agent(format!("creating the pod's sandbox container {id}"), e))?;
        Ok(Attachment {
            device: String::new(),
            slot: None,
        })
    }
    /// Takes a container's rootfs back after the agent removed the container.
    fn detach(&self, attachment: &Attachment) -> Result<()>;
    /// Pauses every vCPU (the whole pod).
    fn pause(&self) -> Result<()>;
    /// Resumes the vCPUs.
    fn resume(&self) -> Result<()>;
    /// Stops the VM; idempotent.
    fn shutdown(&self) -> Result<()>;
    /// Force-stops the VM at once (SIGKILL), when its guest no longer
    /// answers; its death then reaches [`Sandbox::death`]'s receiver. A
    /// sandbox without a VM process has nothing to kill.
    fn kill(&self) -> Result<()> {
        Err(Error::Unimplemented(
            "this sandbox has no VM process to kill".into(),
        ))
    }
    /// The first call returns a receiver that gets why the VM ended when it
    /// ended without a [`Sandbox::shutdown`] (crash, `kill -9`, OOM killer,
    /// [`Sandbox::kill`]); it is closed without a value after a shutdown.
    /// `None`: no VM process to watch (or asked before).
    fn death(&self) -> Option<Death> {
        None
    }
    /// Snapshots the VM (memory, vCPU and device state, every read-write
    /// disk) into `staging`, a node-store staging directory named by the
    /// new id: all of memory when `full`, else the pages changed since the
    /// VM's baseline. The VM keeps running.
    fn snapshot(&self, staging: &Path, full: bool) -> Result<VmSnapshot>;
    /// Rolls the VM back in place to the published snapshot `dir`, all or
    /// nothing, and reconnects to the agent. A refusal leaves the VM
    /// running on its previous state; [`crate::Error::is_vm_lost`] says
    /// when the VM is gone.
    fn rollback(&self, dir: &Path) -> Result<VmRollback>;
    /// The node store the pod's snapshots go to: the store of the template
    /// its VM was restored from.
    fn snapshot_store(&self) -> Result<std::path::PathBuf>;
    /// Hands out the running container named `name` of the snapshot this
    /// VM was restored from, once; `None` when there is none (always, for
    /// a VM restored from the template).
    fn take_restored(&self, name: &str) -> Option<Restored>;
    /// Charges host process `pid` (a file server of the pod's) to the pod:
    /// into the sandbox's cgroup with its VMM, when it has one.
    fn charge(&self, pid: u32) -> Result<()> {
        let _ = pid;
        Ok(())
    }
    /// A stream to the guest's vsock `port` (the VMM's `CONNECT`).
    fn open_port(&self, port: u32, timeout: Duration) -> Result<std::os::unix::net::UnixStream> {
        let _ = (port, timeout);
        Err(Error::FailedPrecondition(
            "this sandbox has no vsock socket to reach the guest through".into(),
        ))
    }
    /// The container [`Sandbox::take_restored`] would hand out for
    /// `name` (its own, or an app template's); it is left there. `None`:
    /// there is none.
    fn restored_for(&self, name: &str) -> Option<Restored> {
        let _ = name;
        None
    }
    /// The pod's network path: the policy in force and the counters;
    /// `None` for a pod without one.
    fn network_stats(&self) -> Result<Option<NetworkStats>> {
        Ok(None)
    }
    /// Replaces the egress policy on the pod's network path while it runs
    /// (a rollback keeps it: the path is the host's, not the guest's).
    fn set_egress_policy(&self, policy: &EgressPolicy) -> Result<()> {
        let _ = policy;
        Err(Error::FailedPrecondition(
            "the pod has no network path (no network namespace)".into(),
        ))
    }
}

/// A pod's network path as the `Twig` service reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkStats {
    /// The egress policy in force.
    pub policy: EgressPolicy,
    /// Frames and bytes passed and dropped, by reason.
    pub counters: Counters,
}

/// Runs `call` on the sandbox's current agent connection; when it fails
/// because a rollback replaced that connection meanwhile, runs it again on
/// the new one (the long-lived calls — waits, output reads — span
/// rollbacks this way).
pub fn with_agent<T>(
    sandbox: &dyn Sandbox,
    mut call: impl FnMut(&AgentClient) -> std::result::Result<T, AgentError>,
) -> std::result::Result<T, AgentError> {
    loop {
        let epoch = sandbox.agent_epoch();
        match call(&sandbox.agent()) {
            Err(e) if sandbox.agent_epoch() != epoch => {
                tracing::debug!("the agent connection was replaced during a call ({e}); again");
            }
            other => return other,
        }
    }
}

/// Why the VM of a sandbox ended without being asked to (see
/// [`Sandbox::death`]).
pub type Death = tokio::sync::oneshot::Receiver<String>;

/// Makes the sandbox when a shim's first container is created.
pub trait Launcher: Send + Sync {
    /// Starts the sandbox for group `sandbox_id`, whose first container's
    /// bundle is `bundle` and rootfs block image `rootfs` (under CRI, the
    /// pod's sandbox container).
    fn launch(&self, sandbox_id: &str, bundle: &Path, rootfs: &Path) -> Result<Arc<dyn Sandbox>>;
}

/// A twig-agent on the host (`twig-agent --listen unix://…`): rootfs images
/// are attached as loop devices. For tests and development; it has no VM to
/// pause.
pub struct HostSandbox {
    agent: AgentClient,
    timeout: Duration,
}

impl HostSandbox {
    /// Connects to the agent listening on the Unix socket `socket`.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<HostSandbox> {
        let agent = AgentClient::connect_unix(socket, timeout).map_err(|e| {
            Error::agent(
                format!("connecting to the agent at {}", socket.display()),
                e,
            )
        })?;
        Ok(HostSandbox { agent, timeout })
    }
}

fn losetup(args: &[&str], image: Option<&Path>) -> Result<String> {
    let mut cmd = Command::new("losetup");
    cmd.args(args);
    if let Some(i) = image {
        cmd.arg(i);
    }
    let out = cmd
        .output()
        .map_err(|e| Error::io(format!("running {cmd:?}"), e))?;
    if !out.status.success() {
        return Err(Error::Internal(format!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

impl Sandbox for HostSandbox {
    fn agent(&self) -> AgentClient {
        self.agent.clone()
    }

    fn agent_epoch(&self) -> u64 {
        0
    }

    fn attach_disk(&self, image: &Path, read_only: bool) -> Result<Attachment> {
        let mut args = vec!["--find", "--show"];
        if read_only {
            args.push("--read-only");
        }
        let device = losetup(&args, Some(image))?;
        Ok(Attachment { device, slot: None })
    }

    fn create_container(
        &self,
        id: &str,
        image: &Path,
        read_only: bool,
        block_volumes: Vec<BlockVolume>,
        spec_json: &[u8],
    ) -> Result<Attachment> {
        let attachment = self.attach_disk(image, read_only)?;
        let disks = ContainerDisks {
            rootfs_device: attachment.device.clone(),
            rootfs_read_only: read_only,
            rootfs_bytes: 0,
            block_volumes,
        };
        if let Err(e) = self
            .agent
            .create_container_on_disks(id, disks, spec_json, self.timeout)
        {
            if let Err(d) = self.detach(&attachment) {
                tracing::warn!(device = %attachment.device, "detaching after a failed create: {d}");
            }
            return Err(Error::agent(format!("creating container {id}"), e));
        }
        Ok(attachment)
    }

    fn detach(&self, attachment: &Attachment) -> Result<()> {
        if attachment.device.is_empty() {
            return Ok(());
        }
        losetup(&["-d", &attachment.device], None).map(|_| ())
    }

    fn pause(&self) -> Result<()> {
        Err(Error::Unimplemented(
            "pause needs a VM; the host sandbox has none".into(),
        ))
    }

    fn resume(&self) -> Result<()> {
        Err(Error::Unimplemented(
            "resume needs a VM; the host sandbox has none".into(),
        ))
    }

    fn shutdown(&self) -> Result<()> {
        Ok(())
    }

    fn snapshot(&self, _staging: &Path, _full: bool) -> Result<VmSnapshot> {
        Err(Error::Unimplemented(
            "snapshots need a VM; the host sandbox has none".into(),
        ))
    }

    fn rollback(&self, _dir: &Path) -> Result<VmRollback> {
        Err(Error::Unimplemented(
            "rollback needs a VM; the host sandbox has none".into(),
        ))
    }

    fn snapshot_store(&self) -> Result<std::path::PathBuf> {
        Err(Error::Unimplemented(
            "snapshots need a VM; the host sandbox has none".into(),
        ))
    }

    fn take_restored(&self, _name: &str) -> Option<Restored> {
        None
    }
}

/// A [`Launcher`] that hands out one existing sandbox (tests, and a shim
/// pointed at a host agent).
pub struct Fixed(pub Arc<dyn Sandbox>);

impl Launcher for Fixed {
    fn launch(
        &self,
        _sandbox_id: &str,
        _bundle: &Path,
        _rootfs: &Path,
    ) -> Result<Arc<dyn Sandbox>> {
        Ok(self.0.clone())
    }
}
