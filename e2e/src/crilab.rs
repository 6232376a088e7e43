//! What the lab's CRI scenarios share: a [`CriNode`] and a client of it,
//! whose failures panic with the node's logs (a test's way to fail), the
//! counter the scenarios run, and their runtime.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use twig_controller::sandbox::{ContainerdLocator, SandboxLocator};
use twig_controller::shim::Sandbox;
use twig_cri::{api, CriClient};

use crate::cri::CriNode;
use crate::node::NodeConfig;

/// Deadline of the guest's progress (the lab is slow).
pub const PROGRESS: Duration = Duration::from_secs(120);
/// ExecSync's own limit.
pub const EXEC: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(100);

/// Counts in tmpfs (`/dev/shm/count`, guest memory), on the rootfs disk
/// (`/count`) and on stdout (`count N`), every 50 ms; each file is
/// replaced by a rename, so a reader never sees it half-written.
pub const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/count.new; \
     mv /dev/shm/count.new /dev/shm/count; echo $i > /count.new; mv /count.new /count; \
     echo count $i; sleep 0.05; done";

/// The single-threaded runtime a scenario runs on.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("a tokio runtime: {e}"))
}

/// The first line a peer sends on a connection to `listener` within
/// `within` (the peer need not close its side), or why none came.
pub fn accept_line(listener: &TcpListener, within: Duration) -> Result<String, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + within;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(Duration::from_secs(10)))
                    .map_err(|e| e.to_string())?;
                let mut got = String::new();
                BufReader::new(s)
                    .read_line(&mut got)
                    .map_err(|e| e.to_string())?;
                return Ok(got);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("no connection within {within:?}: {e}")),
        }
    }
}

/// Polls container `id` until it exited, within `within`, and returns its
/// status; fails the test with `node`'s logs otherwise.
pub async fn wait_exited(
    node: &CriNode,
    cri: &CriClient,
    id: &str,
    within: Duration,
) -> api::ContainerStatus {
    let deadline = Instant::now() + within;
    loop {
        let status = cri
            .container_status(id)
            .await
            .unwrap_or_else(|e| panic!("{}", node.cri_error("ContainerStatus", e)));
        if status.state() == api::ContainerState::ContainerExited {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "container {id} did not exit within {within:?}: {status:?}\n{}",
            node.node().logs()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// A CRI node and a CRI client of it.
pub struct CriLab {
    /// The node.
    pub node: CriNode,
    /// A client of its CRI.
    pub cri: CriClient,
}

impl CriLab {
    /// Starts the node ([`CriNode::start`]) and connects.
    pub async fn start() -> CriLab {
        CriLab::start_configured(|_| {}).await
    }

    /// Starts the node with the lab's configuration changed by `f`
    /// ([`CriNode::start_configured`]) and connects.
    pub async fn start_configured(f: impl FnOnce(&mut NodeConfig)) -> CriLab {
        let node = CriNode::start_configured(f).unwrap_or_else(|e| panic!("CRI node: {e}"));
        let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
        CriLab { node, cri }
    }

    /// Fails the test with a CRI error, where it happened and the logs.
    pub fn fail(&self, what: &str, e: twig_cri::Error) -> ! {
        panic!("{}", self.node.cri_error(what, e))
    }

    /// The node's directory.
    pub fn dir(&self) -> PathBuf {
        self.node
            .node()
            .dir()
            .unwrap_or_else(|e| panic!("{e}"))
            .to_path_buf()
    }

    /// The node's logs.
    pub fn logs(&self) -> String {
        self.node.node().logs()
    }

    /// `argv` in container `id`: (exit code, stdout trimmed).
    pub async fn exec(&self, id: &str, argv: &[&str]) -> (i32, String) {
        let out = self
            .cri
            .exec_sync(id, argv, EXEC)
            .await
            .unwrap_or_else(|e| self.fail(&format!("ExecSync {argv:?}"), e));
        (
            out.exit_code,
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    }

    /// The counter in `file` of container `id`, once it satisfies `ok`
    /// (within [`PROGRESS`]).
    pub async fn wait_count(&self, id: &str, file: &str, ok: impl Fn(u64) -> bool) -> u64 {
        let deadline = Instant::now() + PROGRESS;
        loop {
            let (code, out) = self.exec(id, &["cat", file]).await;
            if let (0, Ok(n)) = (code, out.parse::<u64>()) {
                if ok(n) {
                    return n;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{file} of {id} did not get there within {PROGRESS:?} (last: {out:?})\n{}",
                self.logs()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// RunPodSandbox of `pod` on runtime `handler`, then CreateContainer +
    /// StartContainer of `container`: (sandbox id, container id).
    pub async fn run_pod(
        &self,
        pod: &api::PodSandboxConfig,
        handler: &str,
        container: &api::ContainerConfig,
    ) -> (String, String) {
        let pod_id = self
            .cri
            .run_pod_sandbox(pod, handler)
            .await
            .unwrap_or_else(|e| self.fail("RunPodSandbox", e));
        let id = self.add_container(&pod_id, pod, container).await;
        (pod_id, id)
    }

    /// Creates and starts `container` in running pod `pod_id` (of config
    /// `pod`); its id.
    pub async fn add_container(
        &self,
        pod_id: &str,
        pod: &api::PodSandboxConfig,
        container: &api::ContainerConfig,
    ) -> String {
        let name = container
            .metadata
            .as_ref()
            .map(|m| m.name.as_str())
            .unwrap_or_default();
        let id = self
            .cri
            .create_container(pod_id, container, pod)
            .await
            .unwrap_or_else(|e| self.fail(&format!("CreateContainer {name}"), e));
        self.cri
            .start_container(&id)
            .await
            .unwrap_or_else(|e| self.fail(&format!("StartContainer {name}"), e));
        id
    }

    /// The twig shim of `pod`, as the controller finds it
    /// (`ContainerdLocator` on CRI's task directory, by the pod's UID).
    pub async fn sandbox_of(&self, pod: &api::PodSandboxConfig) -> Sandbox {
        let locator = ContainerdLocator::new(
            self.dir()
                .join("containerd/state/io.containerd.runtime.v2.task")
                .join(crate::cri::CRI_NAMESPACE),
        );
        let mut of = Pod::default();
        of.metadata.uid = pod.metadata.as_ref().map(|m| m.uid.clone());
        locator
            .locate(&of)
            .await
            .unwrap_or_else(|e| panic!("locating the pod: {e}\n{}", self.logs()))
    }

    /// StopPodSandbox and RemovePodSandbox.
    pub async fn remove_pod(&self, pod_id: &str) {
        self.cri
            .stop_pod_sandbox(pod_id)
            .await
            .unwrap_or_else(|e| self.fail("StopPodSandbox", e));
        self.cri
            .remove_pod_sandbox(pod_id)
            .await
            .unwrap_or_else(|e| self.fail("RemovePodSandbox", e));
    }
}
