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

use twig_agent::client::AgentClient;

use crate::error::{Error, Result};

/// A container's rootfs as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// The block device the agent mounts (`/dev/vdc`, `/dev/loop3`).
    pub device: String,
    /// The VM's disk slot, if it is one.
    pub slot: Option<usize>,
}

/// One pod's VM (or its stand-in): an agent, and a way to give it a disk.
/// Calls block; the service runs them on blocking threads.
pub trait Sandbox: Send + Sync {
    /// The agent that runs the containers.
    fn agent(&self) -> &AgentClient;
    /// Hands the block image `image` to the guest and creates container
    /// `id` on it with `spec_json`; on failure nothing stays attached.
    fn create_container(
        &self,
        id: &str,
        image: &Path,
        read_only: bool,
        spec_json: &[u8],
    ) -> Result<Attachment>;
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
}

/// Why the VM of a sandbox ended without being asked to (see
/// [`Sandbox::death`]).
pub type Death = tokio::sync::oneshot::Receiver<String>;

/// Makes the sandbox when a shim's first container is created.
pub trait Launcher: Send + Sync {
    /// Starts the sandbox for group `sandbox_id`, whose first container's
    /// bundle is `bundle`.
    fn launch(&self, sandbox_id: &str, bundle: &Path) -> Result<Arc<dyn Sandbox>>;
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
    fn agent(&self) -> &AgentClient {
        &self.agent
    }

    fn create_container(
        &self,
        id: &str,
        image: &Path,
        read_only: bool,
        spec_json: &[u8],
    ) -> Result<Attachment> {
        let mut args = vec!["--find", "--show"];
        if read_only {
            args.push("--read-only");
        }
        let device = losetup(&args, Some(image))?;
        let attachment = Attachment { device, slot: None };
        if let Err(e) =
            self.agent
                .create_container(id, &attachment.device, read_only, spec_json, self.timeout)
        {
            if let Err(d) = self.detach(&attachment) {
                tracing::warn!(device = %attachment.device, "detaching after a failed create: {d}");
            }
            return Err(Error::agent(format!("creating container {id}"), e));
        }
        Ok(attachment)
    }

    fn detach(&self, attachment: &Attachment) -> Result<()> {
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
}

/// A [`Launcher`] that hands out one existing sandbox (tests, and a shim
/// pointed at a host agent).
pub struct Fixed(pub Arc<dyn Sandbox>);

impl Launcher for Fixed {
    fn launch(&self, _sandbox_id: &str, _bundle: &Path) -> Result<Arc<dyn Sandbox>> {
        Ok(self.0.clone())
    }
}
