//! containerd's Task API (the shim API, `containerd.task.v2.Task` and
//! `v3`) for the pod of one shim: a thin adapter that checks and decodes
//! each request, calls the [`Pod`], and encodes its answer (errors as
//! containerd's errdefs codes, [`crate::Error::code`]). Calls that change
//! the pod run to their end whatever happens to the caller
//! ([`to_completion`]).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api;
use containerd_shim_protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat,
};
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::protobuf::{EnumOrUnknown, MessageField, MessageFull};
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::r#async::TtrpcContext;
use containerd_shim_protos::ttrpc::Result as TtrpcResult;
use containerd_shim_protos::types::task::{ProcessInfo, Status};

use crate::error::{Error, Result};
use crate::pod::process::{timestamp, Exited, Phase};
use crate::pod::{shim_pid, to_completion, EventTx, NewContainer, Pod};
use crate::sandbox::Launcher;
use crate::stdio::StdioPaths;

/// The Task service of one shim.
#[derive(Clone)]
pub struct TaskService {
    pod: Pod,
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
            pod: Pod::new(launcher, events, exit, timeout),
        }
    }

    /// The pod the service runs (the `Twig` service's too).
    pub fn pod(&self) -> &Pod {
        &self.pod
    }
}

fn delete_response(exited: Exited) -> api::DeleteResponse {
    api::DeleteResponse {
        pid: shim_pid(),
        exit_status: exited.status,
        exited_at: timestamp(exited.at),
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

/// An exec's OCI process from its request: present, and JSON.
fn exec_process(req: &api::ExecProcessRequest) -> Result<Vec<u8>> {
    let process_json = req
        .spec
        .as_ref()
        .map(|a| a.value.clone())
        .filter(|v| !v.is_empty())
        .ok_or_else(|| Error::InvalidArgument(format!("exec {}: no process spec", req.exec_id)))?;
    serde_json::from_slice::<serde_json::Value>(&process_json)
        .map_err(|e| Error::InvalidArgument(format!("exec {}: process spec: {e}", req.exec_id)))?;
    Ok(process_json)
}

#[async_trait]
impl Task for TaskService {
    async fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let s = self.pod.state(&req.id, &req.exec_id)?;
        let status = match (s.phase, s.paused) {
            (Phase::Created, _) => Status::CREATED,
            (Phase::Running, true) => Status::PAUSED,
            (Phase::Running, false) => Status::RUNNING,
            (Phase::Stopped, _) => Status::STOPPED,
        };
        Ok(api::StateResponse {
            id: req.id.clone(),
            bundle: s.bundle,
            pid: shim_pid(),
            status: EnumOrUnknown::new(status),
            stdin: s.stdio.stdin,
            stdout: s.stdio.stdout,
            stderr: s.stdio.stderr,
            terminal: s.stdio.terminal,
            exit_status: s.exited.map(|e| e.status).unwrap_or_default(),
            exited_at: s.exited.map(|e| timestamp(e.at)).unwrap_or_default(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    async fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        tracing::info!(id = req.id, bundle = req.bundle, "create");
        if req.id.is_empty() {
            return Err(Error::InvalidArgument("create: empty container id".into()).into());
        }
        if !req.checkpoint.is_empty() {
            return Err(Error::Unimplemented(
                "create from a checkpoint: use twig.dev/restore-from".into(),
            )
            .into());
        }
        let new = NewContainer {
            stdio: StdioPaths {
                stdin: req.stdin,
                stdout: req.stdout,
                stderr: req.stderr,
                terminal: req.terminal,
            },
            id: req.id,
            bundle: req.bundle,
            rootfs: req.rootfs,
        };
        to_completion(&self.pod, |p| async move { p.create(new).await }).await?;
        Ok(api::CreateTaskResponse {
            pid: shim_pid(),
            ..Default::default()
        })
    }

    async fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        tracing::info!(id = req.id, exec_id = req.exec_id, "start");
        to_completion(&self.pod, |p| async move {
            p.start(&req.id, &req.exec_id).await
        })
        .await?;
        Ok(api::StartResponse {
            pid: shim_pid(),
            ..Default::default()
        })
    }

    async fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        tracing::info!(id = req.id, exec_id = req.exec_id, "delete");
        let exited = to_completion(&self.pod, |p| async move {
            p.delete(&req.id, &req.exec_id).await
        })
        .await?;
        Ok(delete_response(exited))
    }

    async fn pids(
        &self,
        _ctx: &TtrpcContext,
        req: api::PidsRequest,
    ) -> TtrpcResult<api::PidsResponse> {
        if !self.pod.contains(&req.id) {
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
        to_completion(&self.pod, |p| async move { p.pause().await }).await?;
        Ok(api::Empty::default())
    }

    async fn resume(
        &self,
        _ctx: &TtrpcContext,
        _req: api::ResumeRequest,
    ) -> TtrpcResult<api::Empty> {
        to_completion(&self.pod, |p| async move { p.resume().await }).await?;
        Ok(api::Empty::default())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        tracing::info!(
            id = req.id,
            exec_id = req.exec_id,
            signal = req.signal,
            "kill"
        );
        to_completion(&self.pod, |p| async move {
            p.kill(&req.id, &req.exec_id, req.signal).await
        })
        .await?;
        Ok(api::Empty::default())
    }

    async fn exec(
        &self,
        _ctx: &TtrpcContext,
        req: api::ExecProcessRequest,
    ) -> TtrpcResult<api::Empty> {
        tracing::info!(id = req.id, exec_id = req.exec_id, "exec");
        if req.exec_id.is_empty() {
            return Err(Error::InvalidArgument("exec: empty exec id".into()).into());
        }
        let process_json = exec_process(&req)?;
        let stdio = StdioPaths {
            stdin: req.stdin,
            stdout: req.stdout,
            stderr: req.stderr,
            terminal: req.terminal,
        };
        let (id, exec_id) = (req.id, req.exec_id);
        to_completion(&self.pod, |p| async move {
            p.exec(&id, &exec_id, stdio, process_json).await
        })
        .await?;
        Ok(api::Empty::default())
    }

    async fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        self.pod
            .resize(&req.id, &req.exec_id, req.height, req.width)
            .await?;
        Ok(api::Empty::default())
    }

    async fn close_io(
        &self,
        _ctx: &TtrpcContext,
        req: api::CloseIORequest,
    ) -> TtrpcResult<api::Empty> {
        if req.stdin {
            to_completion(&self.pod, |p| async move {
                p.close_stdin(&req.id, &req.exec_id).await
            })
            .await?;
        }
        Ok(api::Empty::default())
    }

    async fn wait(
        &self,
        _ctx: &TtrpcContext,
        req: api::WaitRequest,
    ) -> TtrpcResult<api::WaitResponse> {
        let exited = self.pod.wait(&req.id, &req.exec_id).await?;
        Ok(api::WaitResponse {
            exit_status: exited.status,
            exited_at: timestamp(exited.at),
            ..Default::default()
        })
    }

    async fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        let s = self.pod.stats(&req.id).await?;
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

    async fn update(
        &self,
        _ctx: &TtrpcContext,
        req: api::UpdateTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        tracing::info!(id = req.id, "update");
        let Some(resources) = req.resources.as_ref() else {
            return Err(
                Error::InvalidArgument(format!("update of {}: no resources", req.id)).into(),
            );
        };
        if !resources.type_url.ends_with("/LinuxResources") {
            return Err(Error::InvalidArgument(format!(
                "update of {}: resources of type {:?}, not the OCI spec's LinuxResources",
                req.id, resources.type_url
            ))
            .into());
        }
        self.pod.update(&req.id, resources.value.clone()).await?;
        Ok(api::Empty::new())
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
        to_completion(&self.pod, |p| async move { p.shutdown(req.now).await }).await?;
        Ok(api::Empty::default())
    }
}
