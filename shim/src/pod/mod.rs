//! The pod of one shim: its VM (made when the first container is created)
//! and its containers and their processes as containerd sees them, every
//! exit recorded and published as containerd's task events. The Task API
//! adapter ([`crate::service`]) and the `Twig` service
//! ([`crate::twig_service`]) call it; it reaches the VM only through the
//! [`Sandbox`] seam.
//!
//! - this module: the pod's state, and the calls that read it or act on
//!   the whole pod (state, wait, stdin, terminal size, pause, stats,
//!   shutdown; the containers as the pod-level operations see them);
//! - [`lifecycle`]: create (and adopt), start, exec, kill, delete;
//! - `exits`: waiting for processes to exit, recording and publishing
//!   exits, and the VM's death (every process reported exited);
//! - [`guest_spec`]: the spec the guest's agent gets;
//! - [`process`]: what is kept about each container and process.

mod exits;
pub mod guest_spec;
pub mod lifecycle;
pub mod process;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api::Mount;
use containerd_shim_protos::events::task::{TaskPaused, TaskResumed};
use containerd_shim_protos::protobuf::MessageDyn;
use containerd_shim_protos::topics;
use tokio::sync::{mpsc, watch};
use twig_agent::proto::agent::StatsResponse;

use crate::error::{Error, Result};
use crate::resources::limits;
use crate::resources::watch::Watcher;
use crate::sandbox::{Launcher, Sandbox};
use crate::stdio::StdioPaths;
use process::{Container, Exited, Origin, Phase, Proc};

pub use exits::VM_DEATH_STATUS;

/// How long a server-side wait of the agent lasts before it is asked again.
const AGENT_WAIT: Duration = Duration::from_secs(30);
/// After a process exits, how long its output may take to drain before
/// the exit is reported anyway.
const DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// An event for containerd's event service.
pub struct Event {
    /// The topic (`/tasks/exit`, …).
    pub topic: &'static str,
    /// The event message (`TaskExit`, …).
    pub message: Box<dyn MessageDyn>,
}

/// Where events go; the server forwards them to containerd.
pub type EventTx = mpsc::UnboundedSender<Event>;

/// A container containerd asks to create.
pub struct NewContainer {
    /// containerd's container id.
    pub id: String,
    /// Its bundle directory (the OCI spec).
    pub bundle: String,
    /// Its rootfs mounts: one twig-snapshotter block image.
    pub rootfs: Vec<Mount>,
    /// Its init's stdio.
    pub stdio: StdioPaths,
}

/// A process as the Task API's State reports it.
pub struct ProcessState {
    /// Its container's bundle directory.
    pub bundle: String,
    /// Where it is in its life.
    pub phase: Phase,
    /// Whether the pod's VM is paused.
    pub paused: bool,
    /// Its stdio as containerd named it.
    pub stdio: StdioPaths,
    /// Its exit, once it exited.
    pub exited: Option<Exited>,
}

/// A container as the pod-level operations (snapshot, rollback) see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerView {
    /// containerd's container id.
    pub id: String,
    /// The id the guest's agent knows it by (`id`, or for a container
    /// adopted in a clone, its source's).
    pub guest_id: String,
    /// Its bundle (the OCI spec, with CRI's annotations).
    pub bundle: PathBuf,
    /// The VM's disk slot holding its rootfs.
    pub slot: Option<usize>,
    /// Whether its init process runs.
    pub running: bool,
    /// How many raw block volumes it has (host devices in disk slots).
    pub block_volumes: usize,
    /// How many host directories are shared with it.
    pub shares: usize,
    /// The container name its guest volumes are named after, where it is
    /// not its own.
    pub mounts_of: Option<String>,
}

/// The pod of one shim.
#[derive(Clone)]
pub struct Pod {
    inner: Arc<Inner>,
}

struct Inner {
    launcher: Arc<dyn Launcher>,
    sandbox: tokio::sync::Mutex<Option<Arc<dyn Sandbox>>>,
    containers: Mutex<HashMap<String, Container>>,
    /// The guest pid of the pod's first container's init: other containers
    /// join its namespaces.
    sandbox_init: Mutex<Option<u32>>,
    /// Whether the pod's containers share its pid namespace (CRI's POD
    /// mode, `shareProcessNamespace`), as its first container after the
    /// sandbox's said.
    shares_pids: Mutex<Option<bool>>,
    paused: Mutex<bool>,
    /// Set once the pod's VM died (see `exits`).
    vm_dead: watch::Sender<bool>,
    events: EventTx,
    exit: Arc<ExitSignal>,
    timeout: Duration,
    /// Keeps the guest's copies of live configuration volumes current.
    watcher: Watcher,
    /// Held while the pod's disk is attached.
    pod_disk: tokio::sync::Mutex<()>,
    /// Shared by CRI's Create and Delete of a container while they change
    /// the pod's containers (in the VM and in `containers`); held
    /// exclusively by a snapshot or rollback from its container list to the
    /// VM's answer, so the list is the VM's.
    membership: tokio::sync::RwLock<()>,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("blocking task: {e}")))?
}

/// The pid containerd is told for every process of the pod: the shim's
/// (the processes run in the VM).
pub fn shim_pid() -> u32 {
    std::process::id()
}

/// Runs `call` on a clone of `service` to its end, in a task of its own,
/// whatever happens to the caller. ttrpc drops a call's future when the
/// caller's deadline passes (containerd gives its handling of a TaskExit
/// 10 s), and a call dropped halfway leaves done in the VM what the shim's
/// state does not record: a Delete whose disk was detached but whose
/// container was never forgotten failed every retry, and CRI's
/// StopPodSandbox waited on it for ever.
pub(crate) async fn to_completion<S, T, F>(service: &S, call: impl FnOnce(S) -> F) -> Result<T>
where
    S: Clone,
    F: std::future::Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    tokio::spawn(call(service.clone()))
        .await
        .map_err(|e| Error::Internal(format!("the call's task ended: {e}")))?
}

impl Pod {
    /// A pod whose sandbox comes from `launcher`, publishing to `events`,
    /// signalling `exit` when containerd shuts it down; `timeout` bounds
    /// each call into the VM.
    pub fn new(
        launcher: Arc<dyn Launcher>,
        events: EventTx,
        exit: Arc<ExitSignal>,
        timeout: Duration,
    ) -> Pod {
        Pod {
            inner: Arc::new(Inner {
                launcher,
                sandbox: tokio::sync::Mutex::new(None),
                containers: Mutex::new(HashMap::new()),
                sandbox_init: Mutex::new(None),
                shares_pids: Mutex::new(None),
                paused: Mutex::new(false),
                vm_dead: watch::channel(false).0,
                events,
                exit,
                timeout,
                watcher: Watcher::default(),
                pod_disk: tokio::sync::Mutex::new(()),
                membership: tokio::sync::RwLock::new(()),
            }),
        }
    }

    fn containers(&self) -> MutexGuard<'_, HashMap<String, Container>> {
        self.inner
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self, topic: &'static str, message: Box<dyn MessageDyn>) {
        if self.inner.events.send(Event { topic, message }).is_err() {
            tracing::warn!(topic, "event dropped: the publisher is gone");
        }
    }

    async fn sandbox(&self) -> Result<Arc<dyn Sandbox>> {
        self.inner
            .sandbox
            .lock()
            .await
            .clone()
            .ok_or_else(|| Error::FailedPrecondition("the pod's VM does not exist yet".into()))
    }

    /// The id the agent knows container `id` by, and whether it was
    /// adopted from a restored VM.
    fn guest_id(&self, id: &str) -> Result<(String, bool)> {
        self.containers()
            .get(id)
            .map(|c| (c.guest_id.clone(), c.origin == Origin::Adopted))
            .ok_or_else(|| Error::NotFound(format!("container {id} not found")))
    }

    fn with_proc<R>(
        &self,
        id: &str,
        exec_id: &str,
        f: impl FnOnce(&mut Proc) -> Result<R>,
    ) -> Result<R> {
        let mut containers = self.containers();
        let c = containers
            .get_mut(id)
            .ok_or_else(|| Error::NotFound(format!("container {id} not found")))?;
        let p = c.process(exec_id).ok_or_else(|| {
            Error::NotFound(format!("process {exec_id} of container {id} not found"))
        })?;
        f(p)
    }

    /// The pid in the VM of the pod's sandbox container's init, whose
    /// namespaces the pod's other containers join.
    pub fn sandbox_pid(&self) -> Option<u32> {
        *self
            .inner
            .sandbox_init
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Holds the pod's containers as they are (no Create or Delete of a
    /// container runs until the guard is dropped): a snapshot's container
    /// list and the VM's snapshot are then of the same pod.
    pub async fn freeze_containers(&self) -> tokio::sync::RwLockWriteGuard<'_, ()> {
        self.inner.membership.write().await
    }

    /// Held by Create and Delete of a container (see
    /// [`Pod::freeze_containers`]).
    pub(crate) async fn changing_containers(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.inner.membership.read().await
    }

    /// The pod's sandbox, once its first container made it.
    pub async fn current_sandbox(&self) -> Option<Arc<dyn Sandbox>> {
        self.inner.sandbox.lock().await.clone()
    }

    /// Whether the pod has container `id`.
    pub fn contains(&self, id: &str) -> bool {
        self.containers().contains_key(id)
    }

    /// The pod's containers, sorted by id.
    pub fn container_views(&self) -> Vec<ContainerView> {
        let mut views: Vec<ContainerView> = self
            .containers()
            .values()
            .map(|c| ContainerView {
                id: c.id.clone(),
                guest_id: c.guest_id.clone(),
                bundle: c.bundle.clone(),
                slot: c.attachment.slot,
                running: c.init.phase == Phase::Running,
                block_volumes: c.block_volumes.len(),
                shares: c.shares.len(),
                mounts_of: c.mounts_of.clone(),
            })
            .collect();
        views.sort_by(|a, b| a.id.cmp(&b.id));
        views
    }

    /// Process `exec_id` (empty: the init) of container `id`, as State
    /// reports it.
    pub fn state(&self, id: &str, exec_id: &str) -> Result<ProcessState> {
        let paused = *self.inner.paused.lock().unwrap_or_else(|p| p.into_inner());
        let mut containers = self.containers();
        let c = containers
            .get_mut(id)
            .ok_or_else(|| Error::NotFound(format!("container {id} not found")))?;
        let bundle = c.bundle.display().to_string();
        let p = c
            .process(exec_id)
            .ok_or_else(|| Error::NotFound(format!("process {exec_id} of {id} not found")))?;
        Ok(ProcessState {
            bundle,
            phase: p.phase,
            paused,
            stdio: p.stdio.clone(),
            exited: p.exited(),
        })
    }

    /// Waits until the process exits; its exit.
    pub async fn wait(&self, id: &str, exec_id: &str) -> Result<Exited> {
        let mut rx = self.with_proc(id, exec_id, |p| Ok(p.exit.subscribe()))?;
        let exited = *rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| Error::NotFound(format!("process {id}/{exec_id} was deleted")))?;
        exited.ok_or_else(|| Error::Internal("exit without a status".into()))
    }

    /// containerd's CloseIO of stdin: the process reads end of file once
    /// what was written before reached it.
    pub async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        let (tx, copier) = self.with_proc(id, exec_id, |p| {
            Ok((p.close_stdin.take(), p.stdin_copier.take()))
        })?;
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
        if let Some(c) = copier {
            if tokio::time::timeout(self.inner.timeout, c).await.is_err() {
                return Err(Error::Internal(format!(
                    "stdin of {id}/{exec_id} did not close in time"
                )));
            }
        }
        Ok(())
    }

    /// Resizes the process's terminal.
    pub async fn resize(&self, id: &str, exec_id: &str, height: u32, width: u32) -> Result<()> {
        let terminal = self.with_proc(id, exec_id, |p| Ok(p.stdio.terminal))?;
        if !terminal {
            return Err(Error::FailedPrecondition(format!(
                "process {id}/{exec_id} has no terminal"
            )));
        }
        let sandbox = self.sandbox().await?;
        let timeout = self.inner.timeout;
        let guest_id = self.guest_id(id)?.0;
        let (id, exec_id) = (id.to_string(), exec_id.to_string());
        blocking(move || {
            sandbox
                .agent()
                .resize_tty(&guest_id, &exec_id, height, width, timeout)
                .map_err(|e| Error::agent(format!("resizing the terminal of {id}/{exec_id}"), e))
        })
        .await
    }

    /// Pauses the pod's VM (every container).
    pub async fn pause(&self) -> Result<()> {
        self.pause_or_resume(false).await
    }

    /// Resumes the pod's VM.
    pub async fn resume(&self) -> Result<()> {
        self.pause_or_resume(true).await
    }

    async fn pause_or_resume(&self, resume: bool) -> Result<()> {
        let sandbox = self.sandbox().await?;
        blocking(move || {
            if resume {
                sandbox.resume()
            } else {
                sandbox.pause()
            }
        })
        .await?;
        *self.inner.paused.lock().unwrap_or_else(|p| p.into_inner()) = !resume;
        let ids: Vec<String> = self.containers().keys().cloned().collect();
        for id in ids {
            if resume {
                self.publish(
                    topics::TASK_RESUMED_EVENT_TOPIC,
                    Box::new(TaskResumed {
                        container_id: id,
                        ..Default::default()
                    }),
                );
            } else {
                self.publish(
                    topics::TASK_PAUSED_EVENT_TOPIC,
                    Box::new(TaskPaused {
                        container_id: id,
                        ..Default::default()
                    }),
                );
            }
        }
        Ok(())
    }

    /// Container `id`'s numbers, as its agent reports them.
    pub async fn stats(&self, id: &str) -> Result<StatsResponse> {
        let id = self.guest_id(id)?.0;
        let sandbox = self.sandbox().await?;
        let timeout = self.inner.timeout;
        blocking(move || {
            sandbox
                .agent()
                .stats(&id, timeout)
                .map_err(|e| Error::agent(format!("stats of {id}"), e))
        })
        .await
    }

    /// containerd's Update (CRI's UpdateContainerResources, kubelet's
    /// in-place resize): container `id`'s limits in the VM become what
    /// `resources` (an OCI `linux.resources`, JSON) gives, within the VM's
    /// shape ([`limits::check_update`]).
    pub async fn update(&self, id: &str, resources: Vec<u8>) -> Result<()> {
        let guest_id = self.guest_id(id)?.0;
        let sandbox = self.sandbox().await?;
        if let Some(shape) = sandbox.shape() {
            limits::check_update(&resources, shape)?;
        }
        let timeout = self.inner.timeout;
        blocking(move || {
            sandbox
                .agent()
                .update_container(&guest_id, &resources, timeout)
                .map_err(|e| Error::agent(format!("updating the resources of {guest_id}"), e))
        })
        .await
    }

    /// containerd's Shutdown: stops the VM and the shim, unless containers
    /// are left and `now` is unset.
    pub async fn shutdown(&self, now: bool) -> Result<()> {
        if !now && !self.containers().is_empty() {
            return Ok(());
        }
        if let Some(s) = self.inner.sandbox.lock().await.take() {
            blocking(move || s.shutdown()).await?;
        }
        self.inner.exit.signal();
        Ok(())
    }
}
