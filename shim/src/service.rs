//! The Task service (containerd's shim API) for the containers of one pod.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api;
use containerd_shim_protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat,
};
use containerd_shim_protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskOOM, TaskPaused,
    TaskResumed, TaskStart,
};
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::protobuf::{EnumOrUnknown, MessageDyn, MessageField, MessageFull};
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc;
use containerd_shim_protos::ttrpc::r#async::TtrpcContext;
use containerd_shim_protos::ttrpc::Result as TtrpcResult;
use containerd_shim_protos::types::task::{ProcessInfo, Status};
use tokio::sync::{mpsc, oneshot, watch};
use twig_agent::client::Stream;

use crate::error::{Error, Result};
use crate::process::{timestamp, Container, Exited, Origin, Phase, Proc};
use crate::recover;
use crate::sandbox::{with_agent, Attachment, Death, Launcher, Sandbox, SANDBOX_ADOPTION};
use crate::spec::{self, CONTAINER_TYPE_ANNOTATION, CONTAINER_TYPE_SANDBOX};
use crate::stdio::{self, StdioPaths};
use crate::twig_service::CONTAINER_NAME_ANNOTATION;
use crate::vm::slot_device;

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

/// The Task service of one shim.
#[derive(Clone)]
pub struct TaskService {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    launcher: Arc<dyn Launcher>,
    pub(crate) sandbox: tokio::sync::Mutex<Option<Arc<dyn Sandbox>>>,
    containers: Mutex<HashMap<String, Container>>,
    /// The guest pid of the pod's first container's init: other containers
    /// join its namespaces.
    pub(crate) sandbox_init: Mutex<Option<u32>>,
    paused: Mutex<bool>,
    /// Set once the pod's VM died (see `recover`).
    vm_dead: watch::Sender<bool>,
    events: EventTx,
    exit: Arc<ExitSignal>,
    timeout: Duration,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("blocking task: {e}")))?
}

pub(crate) fn shim_pid() -> u32 {
    std::process::id()
}

impl TaskService {
    /// A service whose sandbox comes from `launcher`, publishing to
    /// `events`, signalling `exit` when containerd shuts it down.
    pub fn new(
        launcher: Arc<dyn Launcher>,
        events: EventTx,
        exit: Arc<ExitSignal>,
        timeout: Duration,
    ) -> TaskService {
        TaskService {
            inner: Arc::new(Inner {
                launcher,
                sandbox: tokio::sync::Mutex::new(None),
                containers: Mutex::new(HashMap::new()),
                sandbox_init: Mutex::new(None),
                paused: Mutex::new(false),
                vm_dead: watch::channel(false).0,
                events,
                exit,
                timeout,
            }),
        }
    }

    pub(crate) fn containers(&self) -> MutexGuard<'_, HashMap<String, Container>> {
        self.inner
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn publish(&self, topic: &'static str, message: Box<dyn MessageDyn>) {
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

    async fn do_create(&self, req: api::CreateTaskRequest) -> Result<api::CreateTaskResponse> {
        let mut timer = CallTimer::new();
        if req.id.is_empty() {
            return Err(Error::InvalidArgument("create: empty container id".into()));
        }
        if !req.checkpoint.is_empty() {
            return Err(Error::Unimplemented(
                "create from a checkpoint: use twig.dev/restore-from".into(),
            ));
        }
        if self.containers().contains_key(&req.id) {
            return Err(Error::AlreadyExists(format!(
                "container {} already exists",
                req.id
            )));
        }
        let bundle = PathBuf::from(&req.bundle);
        let oci = spec::read_spec(&bundle)?;
        let image = spec::rootfs_image(&req.id, &req.rootfs)?;
        let read_only = spec::root_read_only(&oci);
        let name = spec::annotation(&oci, CONTAINER_NAME_ANNOTATION).map(str::to_string);
        let is_sandbox =
            spec::annotation(&oci, CONTAINER_TYPE_ANNOTATION) == Some(CONTAINER_TYPE_SANDBOX);
        let paths = StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let opened = paths.open().await?;
        let sandbox = {
            let mut slot = self.inner.sandbox.lock().await;
            match slot.as_ref() {
                Some(s) => s.clone(),
                None => {
                    let group = spec::grouping(&req.id, &oci);
                    let launcher = self.inner.launcher.clone();
                    let (b, rootfs) = (bundle.clone(), image.clone());
                    let s = timer
                        .vm(blocking(move || launcher.launch(&group, &b, &rootfs)))
                        .await?;
                    if let Some(death) = s.death() {
                        self.watch_vm(death);
                    }
                    *slot = Some(s.clone());
                    s
                }
            }
        };
        let sandbox_init = *self
            .inner
            .sandbox_init
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let guest = spec::guest_spec(oci, sandbox_init)?;
        let spec_json = serde_json::to_vec(&guest)
            .map_err(|e| Error::Internal(format!("encoding the OCI spec: {e}")))?;
        // A container of the pod snapshot the VM was restored from runs
        // already: adopt it (its rootfs is the snapshot's copy on its slot);
        // the new sandbox container adopts the snapshotted one, whose
        // namespaces the adopted containers share.
        let adoption = if is_sandbox {
            Some(SANDBOX_ADOPTION)
        } else {
            name.as_deref()
        };
        let adopted = adoption.and_then(|n| sandbox.take_restored(n));
        let (attachment, origin, guest_id) = match adopted {
            Some(r) => {
                tracing::info!(
                    id = req.id,
                    guest_id = r.guest_id,
                    name,
                    is_sandbox,
                    "adopting a restored container"
                );
                if is_sandbox {
                    if let Some(pid) = r.pid {
                        self.inner
                            .sandbox_init
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(pid);
                    }
                }
                let attachment = Attachment {
                    device: r.slot.map(slot_device).transpose()?.unwrap_or_default(),
                    slot: r.slot,
                };
                (attachment, Origin::Adopted, r.guest_id)
            }
            None => {
                let id = req.id.clone();
                let sb = sandbox.clone();
                let timeout = self.inner.timeout;
                // The pod's sandbox container needs no disk: its init is
                // the agent's built-in pause.
                let attachment = timer
                    .vm(blocking(move || {
                        if is_sandbox {
                            sb.create_pause(&id, &spec_json, timeout)
                        } else {
                            sb.create_container(&id, &image, read_only, &spec_json)
                        }
                    }))
                    .await?;
                (attachment, Origin::Created, req.id.clone())
            }
        };
        let container = Container {
            id: req.id.clone(),
            guest_id,
            bundle,
            origin,
            attachment,
            init: Proc::new("", paths, opened, Vec::new()),
            execs: HashMap::new(),
        };
        self.containers().insert(req.id.clone(), container);
        self.publish(
            topics::TASK_CREATE_EVENT_TOPIC,
            Box::new(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                io: MessageField::some(TaskIO {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                    ..Default::default()
                }),
                pid: shim_pid(),
                ..Default::default()
            }),
        );
        timer.log("create", &req.id, "");
        Ok(api::CreateTaskResponse {
            pid: shim_pid(),
            ..Default::default()
        })
    }

    async fn do_start(&self, req: api::StartRequest) -> Result<api::StartResponse> {
        let mut timer = CallTimer::new();
        let (opened, terminal, process_json) = self.with_proc(&req.id, &req.exec_id, |p| {
            if p.phase != Phase::Created {
                return Err(Error::FailedPrecondition(format!(
                    "process {}/{} was already started",
                    req.id, req.exec_id
                )));
            }
            Ok((
                p.opened.take().unwrap_or_default(),
                p.stdio.terminal,
                p.process_json.clone(),
            ))
        })?;
        let sandbox = self.sandbox().await?;
        let (guest_id, adopted) = self.guest_id(&req.id)?;
        // An adopted container's init runs already.
        let adopted_init = adopted && req.exec_id.is_empty();
        let (id, exec_id) = (guest_id.clone(), req.exec_id.clone());
        let sb = sandbox.clone();
        let timeout = self.inner.timeout;
        let started = timer
            .vm(blocking(move || {
                if adopted_init {
                    Ok(0)
                } else if exec_id.is_empty() {
                    sb.agent()
                        .start_container(&id, timeout)
                        .map_err(|e| Error::agent(format!("starting container {id}"), e))
                } else {
                    sb.agent()
                        .exec_process(&id, &exec_id, &process_json, timeout)
                        .map_err(|e| Error::agent(format!("starting exec {exec_id} in {id}"), e))
                }
            }))
            .await;
        let guest_pid = match started {
            Ok(pid) => pid,
            Err(e) => {
                // Nothing runs: the process stays created, its stdio closed.
                return Err(e);
            }
        };
        if req.exec_id.is_empty() && !adopted_init {
            let mut init = self
                .inner
                .sandbox_init
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            init.get_or_insert(guest_pid);
        }
        let mut copiers = Vec::new();
        let streams = [
            (Stream::Stdout, opened.stdout),
            (Stream::Stderr, opened.stderr),
        ];
        for (stream, out) in streams {
            let Some(out) = out else { continue };
            let (sb, id, e) = (sandbox.clone(), guest_id.clone(), req.exec_id.clone());
            let read: stdio::ReadFn = Arc::new(move || {
                with_agent(sb.as_ref(), |a| {
                    a.read_stream(&id, &e, stream, stdio::CHUNK, AGENT_WAIT)
                })
                .map_err(|err| Error::agent(format!("reading {stream:?} of {id}/{e}"), err))
            });
            copiers.push(stdio::copy_out(read, out));
        }
        let (close_tx, stdin_copier) = match opened.stdin {
            Some(fifo) => {
                let (tx, rx) = oneshot::channel();
                let (sb, id, e) = (sandbox.clone(), guest_id.clone(), req.exec_id.clone());
                let write: stdio::WriteFn = Arc::new(move |d: &[u8]| {
                    with_agent(sb.as_ref(), |a| a.write_stdin(&id, &e, d, timeout))
                        .map_err(|err| Error::agent(format!("writing stdin of {id}/{e}"), err))
                });
                let (sb, id, e) = (sandbox.clone(), guest_id.clone(), req.exec_id.clone());
                let close: stdio::CloseFn = Arc::new(move || {
                    with_agent(sb.as_ref(), |a| a.close_stdin(&id, &e, timeout))
                        .map_err(|err| Error::agent(format!("closing stdin of {id}/{e}"), err))
                });
                (Some(tx), Some(stdio::copy_in(fifo, rx, write, close)))
            }
            None => {
                if !terminal && !adopted_init {
                    // No stdin: the process reads end of file, as under runc.
                    let (sb, id, e) = (sandbox.clone(), guest_id.clone(), req.exec_id.clone());
                    if let Err(err) = timer
                        .vm(blocking(move || {
                            sb.agent()
                                .close_stdin(&id, &e, timeout)
                                .map_err(|err| Error::agent("closing stdin", err))
                        }))
                        .await
                    {
                        tracing::debug!("closing an unused stdin: {err}");
                    }
                }
                (None, None)
            }
        };
        self.with_proc(&req.id, &req.exec_id, |p| {
            p.phase = Phase::Running;
            p.guest_pid = guest_pid;
            p.close_stdin = close_tx;
            p.stdin_copier = stdin_copier;
            Ok(())
        })?;
        self.watch_exit(
            sandbox,
            guest_id,
            req.id.clone(),
            req.exec_id.clone(),
            copiers,
        );
        if req.exec_id.is_empty() {
            self.publish(
                topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart {
                    container_id: req.id.clone(),
                    pid: shim_pid(),
                    ..Default::default()
                }),
            );
        } else {
            self.publish(
                topics::TASK_EXEC_STARTED_EVENT_TOPIC,
                Box::new(TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid: shim_pid(),
                    ..Default::default()
                }),
            );
        }
        timer.log("start", &req.id, &req.exec_id);
        Ok(api::StartResponse {
            pid: shim_pid(),
            ..Default::default()
        })
    }

    /// When the pod's VM dies unasked, every process of the pod exited with
    /// it: recorded and published at once (`recover`).
    fn watch_vm(&self, death: Death) {
        let this = self.clone();
        tokio::spawn(async move {
            let Ok(why) = death.await else { return };
            tracing::error!(
                "the pod's VM died: {why}; every process of the pod is reported exited with {}",
                recover::VM_DEATH_STATUS
            );
            this.inner.vm_dead.send_replace(true);
            let events =
                recover::mark_all_exited(&mut this.containers(), SystemTime::now(), shim_pid());
            for e in events {
                this.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(e));
            }
        });
    }

    /// Whether the pod's VM died, waiting up to `within` for the death
    /// watch to say so (a broken agent connection may be seen first).
    async fn vm_died_within(&self, within: Duration) -> bool {
        let mut rx = self.inner.vm_dead.subscribe();
        let died = tokio::time::timeout(within, rx.wait_for(|dead| *dead))
            .await
            .is_ok_and(|r| r.is_ok());
        died
    }

    /// Waits (through the agent) for the process to exit, lets its output
    /// drain, records the exit and publishes TaskExit.
    fn watch_exit(
        &self,
        sandbox: Arc<dyn Sandbox>,
        guest_id: String,
        id: String,
        exec_id: String,
        copiers: Vec<tokio::task::JoinHandle<()>>,
    ) {
        let this = self.clone();
        tokio::spawn(async move {
            let exit = loop {
                let (sb, i, e) = (sandbox.clone(), guest_id.clone(), exec_id.clone());
                let r = blocking(move || {
                    with_agent(sb.as_ref(), |a| a.wait_process(&i, &e, AGENT_WAIT))
                        .map_err(|err| Error::agent(format!("waiting for {i}/{e}"), err))
                })
                .await;
                match r {
                    Ok(Some(exit)) => break Some(exit),
                    Ok(None) => continue,
                    // A guest that does not answer (frozen, overloaded)
                    // still holds the process: wait on, until it answers
                    // or its VM is killed.
                    Err(Error::Agent {
                        source: twig_agent::client::Error::Timeout { .. },
                        ..
                    }) => {
                        tracing::warn!(id, exec_id, "the agent did not answer a wait; waiting on");
                        continue;
                    }
                    Err(e) => {
                        if this.vm_died_within(this.inner.timeout).await {
                            // The death watch reported it (137).
                            return;
                        }
                        tracing::error!(id, exec_id, "lost the process: {e}");
                        break None;
                    }
                }
            };
            for c in copiers {
                if tokio::time::timeout(DRAIN_DEADLINE, c).await.is_err() {
                    tracing::warn!(
                        id,
                        exec_id,
                        "output did not drain within {DRAIN_DEADLINE:?}"
                    );
                }
            }
            if exit.as_ref().is_some_and(|e| e.oom_killed) {
                // runc's shim reports the OOM kill before the exit, so CRI
                // records the reason `OOMKilled`.
                this.publish(
                    topics::TASK_OOM_EVENT_TOPIC,
                    Box::new(TaskOOM {
                        container_id: id.clone(),
                        ..Default::default()
                    }),
                );
            }
            let exited = match exit {
                Some(e) => Exited::from_agent(e, SystemTime::now()),
                None => Exited {
                    status: 255,
                    at: SystemTime::now(),
                },
            };
            this.record_exit(&id, &exec_id, exited);
        });
    }

    /// Records that a process exited (Wait and State answer it) and
    /// publishes TaskExit.
    fn record_exit(&self, id: &str, exec_id: &str, exited: Exited) {
        // Once: the death of the VM may have recorded it already.
        let recorded = self.with_proc(id, exec_id, |p| Ok(recover::mark_exited(p, exited)));
        if recorded.unwrap_or(false) {
            self.publish(
                topics::TASK_EXIT_EVENT_TOPIC,
                Box::new(TaskExit {
                    container_id: id.to_string(),
                    id: if exec_id.is_empty() { id } else { exec_id }.to_string(),
                    pid: shim_pid(),
                    exit_status: exited.status,
                    exited_at: timestamp(exited.at),
                    ..Default::default()
                }),
            );
        }
    }

    /// Has the agent forget an exited exec (its status and buffered
    /// output), so that execs (probes) do not pile up in the guest. Best
    /// effort: the shim has forgotten it already, and a VM that is gone or
    /// an agent that no longer knows it is fine.
    async fn forget_exec(&self, id: &str, exec_id: &str) {
        let (Ok(sandbox), Ok((guest, _))) = (self.sandbox().await, self.guest_id(id)) else {
            return;
        };
        if *self.inner.vm_dead.borrow() {
            return;
        }
        let (exec_id, timeout) = (exec_id.to_string(), self.inner.timeout);
        let result = blocking(move || {
            match sandbox.agent().remove_process(&guest, &exec_id, timeout) {
                // Gone with a rollback, or with its container.
                Err(e) if e.status_code() == Some("NOT_FOUND") => Ok(()),
                r => r.map_err(|e| Error::agent(format!("removing exec {exec_id} of {guest}"), e)),
            }
        })
        .await;
        if let Err(e) = result {
            tracing::warn!(id, "{e}");
        }
    }

    async fn do_delete(&self, req: api::DeleteRequest) -> Result<api::DeleteResponse> {
        if !req.exec_id.is_empty() {
            let exited = {
                let mut containers = self.containers();
                let c = containers
                    .get_mut(&req.id)
                    .ok_or_else(|| Error::NotFound(format!("container {} not found", req.id)))?;
                let p = c.execs.get(&req.exec_id).ok_or_else(|| {
                    Error::NotFound(format!("exec {} of {} not found", req.exec_id, req.id))
                })?;
                if p.phase == Phase::Running {
                    return Err(Error::FailedPrecondition(format!(
                        "exec {} of {} is running",
                        req.exec_id, req.id
                    )));
                }
                let exited = p.exited();
                c.execs.remove(&req.exec_id);
                exited
            };
            self.forget_exec(&req.id, &req.exec_id).await;
            return Ok(delete_response(exited));
        }
        let (exited, attachment) = {
            let containers = self.containers();
            let c = containers
                .get(&req.id)
                .ok_or_else(|| Error::NotFound(format!("container {} not found", req.id)))?;
            if c.init.phase == Phase::Running {
                return Err(Error::FailedPrecondition(format!(
                    "container {} is running; kill it first",
                    req.id
                )));
            }
            (c.init.exited(), c.attachment.clone())
        };
        let sandbox = self.sandbox().await?;
        let (id, timeout) = (self.guest_id(&req.id)?.0, self.inner.timeout);
        // A dead VM took the container and its disk slot with it.
        let dead = *self.inner.vm_dead.borrow();
        blocking(move || {
            if dead {
                return Ok(());
            }
            match sandbox.agent().remove_container(&id, timeout) {
                Ok(()) => {}
                Err(e) if e.status_code() == Some("NOT_FOUND") => {}
                // No answer at all (the connection is gone: the VM died).
                // The container went with it; refusing would leave
                // containerd retrying a delete that can never succeed.
                Err(e) if e.status_code().is_none() => {
                    tracing::warn!(
                        id,
                        "the agent does not answer ({e}); the container is gone with the VM"
                    );
                    return Ok(());
                }
                Err(e) => return Err(Error::agent(format!("removing container {id}"), e)),
            }
            sandbox.detach(&attachment)
        })
        .await?;
        self.containers().remove(&req.id);
        let resp = delete_response(exited);
        self.publish(
            topics::TASK_DELETE_EVENT_TOPIC,
            Box::new(TaskDelete {
                container_id: req.id.clone(),
                id: req.id.clone(),
                pid: resp.pid,
                exit_status: resp.exit_status,
                exited_at: resp.exited_at.clone(),
                ..Default::default()
            }),
        );
        Ok(resp)
    }

    async fn do_kill(&self, req: api::KillRequest) -> Result<()> {
        let phase = self.with_proc(&req.id, &req.exec_id, |p| Ok(p.phase))?;
        match phase {
            Phase::Stopped => {
                return Err(Error::NotFound(format!(
                    "process {}/{}: process already finished",
                    req.id, req.exec_id
                )))
            }
            Phase::Created => {
                // Nothing runs in the guest yet: as with runc, the signal
                // ends the process (exit status 128 + signal), so a client
                // that kills then waits (containerd's WithProcessKill, when
                // a CRI start failed) sees it exit and can delete it.
                let exited = Exited {
                    status: 128 + req.signal,
                    at: SystemTime::now(),
                };
                self.record_exit(&req.id, &req.exec_id, exited);
                return Ok(());
            }
            Phase::Running => {}
        }
        let sandbox = self.sandbox().await?;
        let timeout = self.inner.timeout;
        let signal = req.signal;
        let sb = sandbox.clone();
        let guest_id = self.guest_id(&req.id)?.0;
        let sent = blocking(move || {
            sb.agent()
                .signal_process(&guest_id, &req.exec_id, req.signal, timeout)
                .map_err(|e| {
                    Error::agent(
                        format!("signal {} to {}/{}", req.signal, req.id, req.exec_id),
                        e,
                    )
                })
        })
        .await;
        match sent {
            // A KILL the guest does not take (it stopped answering, or its
            // VM is gone) ends the pod: the shim kills the VM, and the death
            // watch reports every process exited.
            Err(e)
                if signal == libc::SIGKILL as u32
                    && matches!(
                        e.code(),
                        ttrpc::Code::DEADLINE_EXCEEDED | ttrpc::Code::INTERNAL
                    ) =>
            {
                tracing::error!("{e}: killing the pod's VM");
                if let Err(k) = blocking(move || sandbox.kill()).await {
                    tracing::warn!("killing the VM: {k}");
                }
                if self.vm_died_within(timeout).await {
                    Ok(())
                } else {
                    Err(e)
                }
            }
            other => other,
        }
    }

    async fn do_exec(&self, req: api::ExecProcessRequest) -> Result<()> {
        if req.exec_id.is_empty() {
            return Err(Error::InvalidArgument("exec: empty exec id".into()));
        }
        let process_json = req
            .spec
            .as_ref()
            .map(|a| a.value.clone())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("exec {}: no process spec", req.exec_id))
            })?;
        serde_json::from_slice::<serde_json::Value>(&process_json).map_err(|e| {
            Error::InvalidArgument(format!("exec {}: process spec: {e}", req.exec_id))
        })?;
        {
            let containers = self.containers();
            let c = containers
                .get(&req.id)
                .ok_or_else(|| Error::NotFound(format!("container {} not found", req.id)))?;
            if c.execs.contains_key(&req.exec_id) {
                return Err(Error::AlreadyExists(format!(
                    "exec {} already exists in {}",
                    req.exec_id, req.id
                )));
            }
            if c.init.phase != Phase::Running {
                return Err(Error::FailedPrecondition(format!(
                    "container {} is not running",
                    req.id
                )));
            }
        }
        let paths = StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let opened = paths.open().await?;
        {
            let mut containers = self.containers();
            let c = containers
                .get_mut(&req.id)
                .ok_or_else(|| Error::NotFound(format!("container {} not found", req.id)))?;
            if c.execs.contains_key(&req.exec_id) {
                return Err(Error::AlreadyExists(format!(
                    "exec {} already exists in {}",
                    req.exec_id, req.id
                )));
            }
            c.execs.insert(
                req.exec_id.clone(),
                Proc::new(&req.exec_id, paths, opened, process_json),
            );
        }
        self.publish(
            topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Box::new(TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            }),
        );
        Ok(())
    }

    async fn do_state(&self, req: api::StateRequest) -> Result<api::StateResponse> {
        let paused = *self.inner.paused.lock().unwrap_or_else(|p| p.into_inner());
        let mut containers = self.containers();
        let c = containers
            .get_mut(&req.id)
            .ok_or_else(|| Error::NotFound(format!("container {} not found", req.id)))?;
        let bundle = c.bundle.display().to_string();
        let p = c.process(&req.exec_id).ok_or_else(|| {
            Error::NotFound(format!("process {} of {} not found", req.exec_id, req.id))
        })?;
        let status = match (p.phase, paused) {
            (Phase::Created, _) => Status::CREATED,
            (Phase::Running, true) => Status::PAUSED,
            (Phase::Running, false) => Status::RUNNING,
            (Phase::Stopped, _) => Status::STOPPED,
        };
        let exited = p.exited();
        Ok(api::StateResponse {
            id: req.id.clone(),
            bundle,
            pid: shim_pid(),
            status: EnumOrUnknown::new(status),
            stdin: p.stdio.stdin.clone(),
            stdout: p.stdio.stdout.clone(),
            stderr: p.stdio.stderr.clone(),
            terminal: p.stdio.terminal,
            exit_status: exited.map(|e| e.status).unwrap_or_default(),
            exited_at: exited.map(|e| timestamp(e.at)).unwrap_or_default(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    async fn do_wait(&self, req: api::WaitRequest) -> Result<api::WaitResponse> {
        let mut rx = self.with_proc(&req.id, &req.exec_id, |p| Ok(p.exit.subscribe()))?;
        let exited = *rx.wait_for(Option::is_some).await.map_err(|_| {
            Error::NotFound(format!("process {}/{} was deleted", req.id, req.exec_id))
        })?;
        let exited = exited.ok_or_else(|| Error::Internal("exit without a status".into()))?;
        Ok(api::WaitResponse {
            exit_status: exited.status,
            exited_at: timestamp(exited.at),
            ..Default::default()
        })
    }

    async fn do_close_io(&self, req: api::CloseIORequest) -> Result<()> {
        if !req.stdin {
            return Ok(());
        }
        let (tx, copier) = self.with_proc(&req.id, &req.exec_id, |p| {
            Ok((p.close_stdin.take(), p.stdin_copier.take()))
        })?;
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
        if let Some(c) = copier {
            if tokio::time::timeout(self.inner.timeout, c).await.is_err() {
                return Err(Error::Internal(format!(
                    "stdin of {}/{} did not close in time",
                    req.id, req.exec_id
                )));
            }
        }
        Ok(())
    }

    async fn do_resize(&self, req: api::ResizePtyRequest) -> Result<()> {
        let terminal = self.with_proc(&req.id, &req.exec_id, |p| Ok(p.stdio.terminal))?;
        if !terminal {
            return Err(Error::FailedPrecondition(format!(
                "process {}/{} has no terminal",
                req.id, req.exec_id
            )));
        }
        let sandbox = self.sandbox().await?;
        let timeout = self.inner.timeout;
        let guest_id = self.guest_id(&req.id)?.0;
        blocking(move || {
            sandbox
                .agent()
                .resize_tty(&guest_id, &req.exec_id, req.height, req.width, timeout)
                .map_err(|e| {
                    Error::agent(
                        format!("resizing the terminal of {}/{}", req.id, req.exec_id),
                        e,
                    )
                })
        })
        .await
    }

    async fn do_pause(&self, resume: bool) -> Result<()> {
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

    async fn do_stats(&self, req: api::StatsRequest) -> Result<api::StatsResponse> {
        let id = self.guest_id(&req.id)?.0;
        let sandbox = self.sandbox().await?;
        let timeout = self.inner.timeout;
        let s = blocking(move || {
            sandbox
                .agent()
                .stats(&id, timeout)
                .map_err(|e| Error::agent(format!("stats of {id}"), e))
        })
        .await?;
        Ok(api::StatsResponse {
            stats: MessageField::some(metrics_any(&metrics(
                s.memory_rss_bytes,
                s.cpu_user_us,
                s.cpu_system_us,
                s.process_count,
            ))?),
            ..Default::default()
        })
    }

    async fn do_shutdown(&self, req: api::ShutdownRequest) -> Result<()> {
        if !req.now && !self.containers().is_empty() {
            return Ok(());
        }
        if let Some(s) = self.inner.sandbox.lock().await.take() {
            blocking(move || s.shutdown()).await?;
        }
        self.inner.exit.signal();
        Ok(())
    }
}

fn delete_response(exited: Option<Exited>) -> api::DeleteResponse {
    api::DeleteResponse {
        pid: shim_pid(),
        exit_status: exited.map(|e| e.status).unwrap_or_default(),
        exited_at: timestamp(exited.map(|e| e.at).unwrap_or_else(SystemTime::now)),
        ..Default::default()
    }
}

/// The agent's numbers as the cgroups v1 `Metrics` containerd decodes
/// (`ctr task metrics`, CRI's container stats on a cgroup v1 node): memory
/// usage and RSS, CPU time in nanoseconds, and the process count.
pub fn metrics(rss_bytes: u64, user_us: u64, system_us: u64, processes: u32) -> Metrics {
    let user = user_us.saturating_mul(1000);
    let kernel = system_us.saturating_mul(1000);
    Metrics {
        pids: MessageField::some(PidsStat {
            current: u64::from(processes),
            ..Default::default()
        }),
        cpu: MessageField::some(CPUStat {
            usage: MessageField::some(CPUUsage {
                total: user.saturating_add(kernel),
                user,
                kernel,
                ..Default::default()
            }),
            ..Default::default()
        }),
        memory: MessageField::some(MemoryStat {
            rss: rss_bytes,
            total_rss: rss_bytes,
            usage: MessageField::some(MemoryEntry {
                usage: rss_bytes,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Packs metrics the way containerd's typeurl expects: the bare message
/// name (`io.containerd.cgroups.v1.Metrics`) as the type URL.
pub fn metrics_any(m: &Metrics) -> Result<Any> {
    let value = containerd_shim_protos::protobuf::Message::write_to_bytes(m)
        .map_err(|e| Error::Internal(format!("encoding metrics: {e}")))?;
    Ok(Any {
        type_url: Metrics::descriptor().full_name().to_string(),
        value,
        ..Default::default()
    })
}

#[async_trait]
impl Task for TaskService {
    async fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        Ok(self.do_state(req).await?)
    }

    async fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        tracing::info!(id = req.id, bundle = req.bundle, "create");
        Ok(to_completion(self, |s| async move { s.do_create(req).await }).await?)
    }

    async fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        tracing::info!(id = req.id, exec_id = req.exec_id, "start");
        Ok(to_completion(self, |s| async move { s.do_start(req).await }).await?)
    }

    async fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        tracing::info!(id = req.id, exec_id = req.exec_id, "delete");
        Ok(to_completion(self, |s| async move { s.do_delete(req).await }).await?)
    }

    async fn pids(
        &self,
        _ctx: &TtrpcContext,
        req: api::PidsRequest,
    ) -> TtrpcResult<api::PidsResponse> {
        if !self.containers().contains_key(&req.id) {
            return Err(Error::NotFound(format!("container {} not found", req.id)).into());
        }
        Ok(api::PidsResponse {
            processes: vec![ProcessInfo {
                pid: shim_pid(),
                ..Default::default()
            }],
            ..Default::default()
        })
    }

    async fn pause(&self, _ctx: &TtrpcContext, _req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        to_completion(self, |s| async move { s.do_pause(false).await }).await?;
        Ok(api::Empty::default())
    }

    async fn resume(
        &self,
        _ctx: &TtrpcContext,
        _req: api::ResumeRequest,
    ) -> TtrpcResult<api::Empty> {
        to_completion(self, |s| async move { s.do_pause(true).await }).await?;
        Ok(api::Empty::default())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        tracing::info!(
            id = req.id,
            exec_id = req.exec_id,
            signal = req.signal,
            "kill"
        );
        to_completion(self, |s| async move { s.do_kill(req).await }).await?;
        Ok(api::Empty::default())
    }

    async fn exec(
        &self,
        _ctx: &TtrpcContext,
        req: api::ExecProcessRequest,
    ) -> TtrpcResult<api::Empty> {
        tracing::info!(id = req.id, exec_id = req.exec_id, "exec");
        to_completion(self, |s| async move { s.do_exec(req).await }).await?;
        Ok(api::Empty::default())
    }

    async fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        self.do_resize(req).await?;
        Ok(api::Empty::default())
    }

    async fn close_io(
        &self,
        _ctx: &TtrpcContext,
        req: api::CloseIORequest,
    ) -> TtrpcResult<api::Empty> {
        to_completion(self, |s| async move { s.do_close_io(req).await }).await?;
        Ok(api::Empty::default())
    }

    async fn wait(
        &self,
        _ctx: &TtrpcContext,
        req: api::WaitRequest,
    ) -> TtrpcResult<api::WaitResponse> {
        Ok(self.do_wait(req).await?)
    }

    async fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        Ok(self.do_stats(req).await?)
    }

    async fn connect(
        &self,
        _ctx: &TtrpcContext,
        _req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        Ok(api::ConnectResponse {
            shim_pid: shim_pid(),
            task_pid: shim_pid(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            ..Default::default()
        })
    }

    async fn shutdown(
        &self,
        _ctx: &TtrpcContext,
        req: api::ShutdownRequest,
    ) -> TtrpcResult<api::Empty> {
        tracing::info!(now = req.now, "shutdown");
        to_completion(self, |s| async move { s.do_shutdown(req).await }).await?;
        Ok(api::Empty::default())
    }
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

/// Where a Task call's time went: waiting on the VM (the VMM process
/// restoring it, the guest's agent) or in the shim itself. Logged at the
/// end of a successful Create or Start as a `timing` line (`own_us`,
/// `vm_us`), which `twig-bench cri` reads from containerd's log.
struct CallTimer {
    start: Instant,
    vm: Duration,
}

impl CallTimer {
    fn new() -> CallTimer {
        CallTimer {
            start: Instant::now(),
            vm: Duration::ZERO,
        }
    }

    /// Awaits `f`, a call into the VM, counting its time as the VM's.
    async fn vm<T>(&mut self, f: impl Future<Output = T>) -> T {
        let t = Instant::now();
        let out = f.await;
        self.vm += t.elapsed();
        out
    }

    fn log(&self, call: &str, id: &str, exec_id: &str) {
        let total = self.start.elapsed();
        tracing::info!(
            call,
            id,
            exec_id,
            own_us = total.saturating_sub(self.vm).as_micros() as u64,
            vm_us = self.vm.as_micros() as u64,
            "timing"
        );
    }
}
