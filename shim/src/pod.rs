//! What the pod-level operations (the `Twig` service's snapshot and
//! rollback) need from the Task service: the pod's VM, its containers, and
//! reporting every process exited when the VM is lost.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use containerd_shim_protos::events::task::TaskExit;
use containerd_shim_protos::topics;

use crate::process::{timestamp, Exited, Phase};
use crate::sandbox::Sandbox;
use crate::service::{shim_pid, TaskService};

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
}

impl TaskService {
    /// The pid in the VM of the pod's sandbox container's init, whose
    /// namespaces the pod's other containers join.
    pub fn sandbox_pid(&self) -> Option<u32> {
        *self
            .inner
            .sandbox_init
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The pod's sandbox, once its first container made it.
    pub async fn current_sandbox(&self) -> Option<Arc<dyn Sandbox>> {
        self.inner.sandbox.lock().await.clone()
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
            })
            .collect();
        views.sort_by(|a, b| a.id.cmp(&b.id));
        views
    }

    /// The pod's VM is gone: every process that had not exited is
    /// reported exited now (status 255, as a lost wait; TaskExit events),
    /// and `reason` goes to the log. Nothing runs any more; containerd
    /// deletes the tasks as usual.
    pub fn vm_lost(&self, reason: &str) {
        tracing::error!("the pod's VM is lost; its processes are reported exited: {reason}");
        let at = SystemTime::now();
        let mut exits = Vec::new();
        for c in self.containers().values_mut() {
            let id = c.id.clone();
            let procs = std::iter::once(&mut c.init).chain(c.execs.values_mut());
            for p in procs.filter(|p| p.phase == Phase::Running) {
                let exited = Exited { status: 255, at };
                p.phase = Phase::Stopped;
                if let Some(tx) = p.close_stdin.take() {
                    let _ = tx.send(());
                }
                p.exit.send_replace(Some(exited));
                let pid = if p.exec_id.is_empty() {
                    id.clone()
                } else {
                    p.exec_id.clone()
                };
                exits.push((id.clone(), pid, exited));
            }
        }
        for (container_id, id, exited) in exits {
            self.publish(
                topics::TASK_EXIT_EVENT_TOPIC,
                Box::new(TaskExit {
                    container_id,
                    id,
                    pid: shim_pid(),
                    exit_status: exited.status,
                    exited_at: timestamp(exited.at),
                    ..Default::default()
                }),
            );
        }
    }
}
