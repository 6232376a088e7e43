//! A node in a box for CRI tests and benchmarks: a local registry serving
//! busybox-static images, a CNI bridge, and containerd with its CRI plugin,
//! all under one temp dir and stopped by PID when the [`Node`] is dropped
//! (also while a failing test unwinds).

mod cleanup;
mod containerd;
mod daemon;
mod net;
mod registry;

pub use containerd::{Containerd, RuntimeHandler, CNI_BIN_DIR, RUNC_RUNTIME_TYPE};
pub use daemon::Daemon;
pub use net::NetSlot;
pub use registry::{ImageBuilder, Registry, BUSYBOX};

use crate::api;
use crate::client::{pod_sandbox_config, CriClient};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// What keeps the harness from running.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// Not running as root.
    #[error("the CRI harness needs root (containerd, CNI bridges, mounts); run it as root")]
    NotRoot,
    /// Tools or files the harness needs are absent.
    #[error("the CRI harness needs {0:?}; install them with scripts/install-deps.sh")]
    Missing(Vec<String>),
    /// A file-system or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What the harness was doing.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A tool exited with an error or ran past its deadline.
    #[error("{command} {outcome}:\n{output}")]
    Command {
        /// The command line.
        command: String,
        /// How it ended.
        outcome: String,
        /// Its stdout and stderr.
        output: String,
    },
    /// A daemon did not come up.
    #[error("{name} did not start: {detail}")]
    Startup {
        /// The daemon.
        name: String,
        /// Why, with its log.
        detail: String,
    },
    /// Every network slot is held by another harness.
    #[error("all {0} CNI network slots under /run/twig-cri are held by running harnesses")]
    NoNetSlot(u8),
    /// A CRI call failed.
    #[error(transparent)]
    Cri(#[from] crate::Error),
}

impl HarnessError {
    pub(crate) fn io(what: String, source: std::io::Error) -> HarnessError {
        HarnessError::Io { what, source }
    }
}

/// The tools the harness runs.
const TOOLS: &[&str] = &[
    "containerd",
    "containerd-shim-runc-v2",
    "runc",
    "umoci",
    "skopeo",
    "docker-registry",
    "ip",
];

/// Fails, naming what is missing, unless running as root with every tool,
/// the CNI plugins and a static busybox present.
pub fn require() -> Result<(), HarnessError> {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(HarnessError::NotRoot);
    }
    let on_path = |tool: &str| {
        std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
    };
    let mut missing: Vec<String> = TOOLS
        .iter()
        .filter(|t| !on_path(t))
        .map(|t| t.to_string())
        .collect();
    for plugin in ["bridge", "host-local", "loopback"] {
        let p = Path::new(CNI_BIN_DIR).join(plugin);
        if !p.is_file() {
            missing.push(format!("{} (containernetworking-plugins)", p.display()));
        }
    }
    if !Path::new(BUSYBOX).is_file() {
        missing.push(format!("{BUSYBOX} (busybox-static)"));
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(HarnessError::Missing(missing))
    }
}

/// Runs `cmd` to completion within `within`; its stdout, or an error with
/// everything it printed.
pub fn run(cmd: &mut Command, within: Duration) -> Result<String, HarnessError> {
    let command = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| HarnessError::io(format!("starting {command}"), e))?;
    // Drain both pipes while waiting, so a chatty tool cannot block.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + within;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(daemon::POLL),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    match status {
        Some(s) if s.success() => Ok(stdout),
        other => Err(HarnessError::Command {
            command,
            outcome: other.map_or(format!("did not finish within {within:?}"), |s| {
                format!("failed with {s}")
            }),
            output: format!("{stdout}{stderr}"),
        }),
    }
}

/// What a [`Node`] offers.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// The CRI runtime handlers; `runc` unless told otherwise. Twig's shim
    /// is one more: `RuntimeHandler::parse("twig=io.containerd.twig.v2")`.
    pub runtimes: Vec<RuntimeHandler>,
}

impl Default for NodeOptions {
    fn default() -> NodeOptions {
        NodeOptions {
            runtimes: vec![RuntimeHandler::runc()],
        }
    }
}

/// A registry, a CNI bridge and containerd with its CRI plugin, ready for
/// pods. Drop stops and removes everything it started.
pub struct Node {
    containerd: Containerd,
    images: ImageBuilder,
    registry: Registry,
    net: NetSlot,
    busybox_image: String,
    dir: TempDir,
}

/// The sandbox (pause) image's command: PID 1 of the pod that waits for
/// SIGTERM/SIGINT and exits 0 on either (a bare `sleep` as PID 1 would
/// ignore them).
const PAUSE_CMD: &[&str] = &[
    "/bin/sh",
    "-c",
    "trap 'exit 0' TERM INT; while :; do sleep 2147483647 & wait $!; done",
];

impl Node {
    /// Starts the registry, builds and pushes the pause and busybox
    /// images, reserves a CNI bridge and starts containerd.
    pub fn start(options: &NodeOptions) -> Result<Node, HarnessError> {
        require()?;
        let net = NetSlot::acquire()?;
        let dir = tempfile::Builder::new()
            .prefix("twig-cri-")
            .tempdir()
            .map_err(|e| HarnessError::io("creating the harness temp dir".into(), e))?;
        let registry = Registry::start(&mk(dir.path(), "registry")?)?;
        let images = ImageBuilder::new(&mk(dir.path(), "images")?)?;
        images.image("pause", &[], PAUSE_CMD)?;
        let pause_image = registry.push(images.layout(), "pause", "pause")?;
        let busybox_image = registry.push(images.layout(), "base", "busybox")?;
        let cni_conf_dir = dir.path().join("cni/net.d");
        net.write_cni_config(&cni_conf_dir, &dir.path().join("cni/ipam"))?;
        let containerd = Containerd::start(
            &dir.path().join("containerd"),
            &containerd::CriSettings {
                sandbox_image: &pause_image,
                registry_host: &registry.host(),
                cni_conf_dir: &cni_conf_dir,
                runtimes: &options.runtimes,
            },
        )?;
        tracing::info!(dir = %dir.path().display(), bridge = net.bridge(), "CRI harness up");
        Ok(Node {
            containerd,
            images,
            registry,
            net,
            busybox_image,
            dir,
        })
    }

    /// A CRI client on this node's containerd.
    pub async fn client(&self) -> Result<CriClient, HarnessError> {
        Ok(CriClient::connect(self.containerd.socket()).await?)
    }

    /// The containerd of this node.
    pub fn containerd(&self) -> &Containerd {
        &self.containerd
    }

    /// The registry of this node.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The pod network (bridge, subnet, gateway).
    pub fn net(&self) -> &NetSlot {
        &self.net
    }

    /// The harness's temp dir.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The busybox-static image (command `/bin/sh`, every applet in `/bin`).
    pub fn busybox_image(&self) -> &str {
        &self.busybox_image
    }

    /// Builds `name`: busybox plus `files`, running `cmd`; pushes it to the
    /// registry and returns its reference (not yet pulled).
    pub fn push_image(
        &self,
        name: &str,
        files: &[(&str, &[u8])],
        cmd: &[&str],
    ) -> Result<String, HarnessError> {
        self.images.image(name, files, cmd)?;
        self.registry.push(self.images.layout(), name, name)
    }

    /// A pod sandbox config named `name`, with a fresh uid and its own log
    /// directory under the harness dir.
    pub fn pod_config(&self, name: &str) -> Result<api::PodSandboxConfig, HarnessError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let uid = format!("{}-{n}", std::process::id());
        let logs = mk(self.dir.path(), &format!("pods/{name}-{uid}"))?;
        Ok(pod_sandbox_config(name, &uid, &logs))
    }

    /// Where CRI writes the log of a container with `log_path` in the pod.
    pub fn container_log(pod: &api::PodSandboxConfig, log_path: &str) -> PathBuf {
        Path::new(&pod.log_directory).join(log_path)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        cleanup::remove_pods(self.containerd.socket());
        self.containerd.daemon.stop(Duration::from_secs(10));
        cleanup::kill_runc_containers(self.containerd.runc_root());
        cleanup::kill_shims(self.containerd.socket());
        cleanup::unmount_under(self.dir.path());
        self.net.remove_bridge();
    }
}

fn mk(base: &Path, sub: &str) -> Result<PathBuf, HarnessError> {
    let p = base.join(sub);
    std::fs::create_dir_all(&p)
        .map_err(|e| HarnessError::io(format!("creating {}", p.display()), e))?;
    Ok(p)
}
