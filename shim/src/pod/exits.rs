//! How processes end: each started process's exit is waited for through
//! the agent, its output drained, and the exit recorded (Wait and State
//! answer it) and published (TaskExit). When the pod's VM ends without
//! being asked to (the VMM crashed, was `kill -9`ed, OOM-killed, or the
//! shim killed it because its guest stopped answering), every process of
//! the pod is gone with it: like runc's shim for a container whose init
//! something outside SIGKILLed, each is reported exited with 128 + SIGKILL
//! (137), and one TaskExit per process tells containerd, so `ctr task ls`
//! shows STOPPED and `delete` works.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use containerd_shim_protos::events::task::{TaskExit, TaskOOM};
use containerd_shim_protos::topics;

use super::process::{timestamp, Container, Exited, Phase, Proc};
use super::{blocking, shim_pid, Pod, AGENT_WAIT, DRAIN_DEADLINE};
use crate::error::Error;
use crate::resources::volumes::{self, Volume};
use crate::sandbox::{with_agent, Death, Sandbox};

/// The exit status of every process of a pod whose VM died: 128 + SIGKILL,
/// what runc's shim reports for a container killed from outside.
pub const VM_DEATH_STATUS: u32 = 128 + libc::SIGKILL as u32;

/// Marks every process of `containers` that has not exited yet (running
/// or created) as exited with [`VM_DEATH_STATUS`] at `at`, wakes its
/// waiters and its stdin copier, and returns the TaskExit events to
/// publish (one per process, `pid` the shim's).
pub fn mark_all_exited(
    containers: &mut HashMap<String, Container>,
    at: SystemTime,
    shim_pid: u32,
) -> Vec<TaskExit> {
    let exited = Exited {
        status: VM_DEATH_STATUS,
        at,
    };
    let mut events = Vec::new();
    for c in containers.values_mut() {
        let procs = std::iter::once(&mut c.init).chain(c.execs.values_mut());
        for p in procs {
            if mark_exited(p, exited) {
                events.push(TaskExit {
                    container_id: c.id.clone(),
                    id: if p.exec_id.is_empty() {
                        c.id.clone()
                    } else {
                        p.exec_id.clone()
                    },
                    pid: shim_pid,
                    exit_status: exited.status,
                    exited_at: timestamp(exited.at),
                    ..Default::default()
                });
            }
        }
    }
    events
}

/// Records `exited` for `p` unless it exited already; whether it did now.
pub fn mark_exited(p: &mut Proc, exited: Exited) -> bool {
    if p.phase == Phase::Stopped {
        return false;
    }
    p.phase = Phase::Stopped;
    if let Some(tx) = p.close_stdin.take() {
        let _ = tx.send(());
    }
    p.exit.send_replace(Some(exited));
    true
}

impl Pod {
    /// When the pod's VM dies unasked, every process of the pod exited with
    /// it: recorded and published at once ([`mark_all_exited`]).
    pub(super) fn watch_vm(&self, death: Death) {
        let this = self.clone();
        tokio::spawn(async move {
            let Ok(why) = death.await else { return };
            tracing::error!(
                "the pod's VM died: {why}; every process of the pod is reported exited with {}",
                VM_DEATH_STATUS
            );
            this.inner.vm_dead.send_replace(true);
            let events = mark_all_exited(&mut this.containers(), SystemTime::now(), shim_pid());
            for e in events {
                this.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(e));
            }
        });
    }

    /// Whether the pod's VM died, waiting up to `within` for the death
    /// watch to say so (a broken agent connection may be seen first).
    pub(super) async fn vm_died_within(&self, within: Duration) -> bool {
        let mut rx = self.inner.vm_dead.subscribe();
        let died = tokio::time::timeout(within, rx.wait_for(|dead| *dead))
            .await
            .is_ok_and(|r| r.is_ok());
        died
    }

    /// Waits (through the agent) for the process to exit, lets its output
    /// drain, records the exit and publishes TaskExit.
    pub(super) fn watch_exit(
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
            if exec_id.is_empty() {
                this.copy_back_termination(&sandbox, &id).await;
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

    /// Copies container `id`'s termination message to kubelet's file before
    /// its exit is published (CRI reads it when it sees the exit).
    async fn copy_back_termination(&self, sandbox: &Arc<dyn Sandbox>, id: &str) {
        let terms: Vec<Volume> = self
            .containers()
            .get(id)
            .map(|c| {
                c.volumes
                    .iter()
                    .filter(|v| matches!(v, Volume::Termination { .. }))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if terms.is_empty() {
            return;
        }
        let (sb, timeout) = (sandbox.clone(), self.inner.timeout);
        let copied = blocking(move || {
            terms
                .iter()
                .try_for_each(|v| volumes::copy_back(&sb.agent(), v, timeout))
        })
        .await;
        if let Err(e) = copied {
            tracing::warn!(id, "the termination message is lost: {e}");
        }
    }

    /// Records that a process exited (Wait and State answer it) and
    /// publishes TaskExit.
    pub(super) fn record_exit(&self, id: &str, exec_id: &str, exited: Exited) {
        // Once: the death of the VM may have recorded it already.
        let recorded = self.with_proc(id, exec_id, |p| Ok(mark_exited(p, exited)));
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
    pub(super) async fn forget_exec(&self, id: &str, exec_id: &str) {
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::pod::process::Origin;
    use crate::sandbox::Attachment;
    use crate::stdio::{OpenedStdio, StdioPaths};

    fn proc(exec_id: &str, phase: Phase) -> Proc {
        let mut p = Proc::new(
            exec_id,
            StdioPaths::default(),
            OpenedStdio::default(),
            Vec::new(),
        );
        p.phase = phase;
        p
    }

    #[test]
    fn every_live_process_of_the_pod_exits_137_once() {
        let done = Exited {
            status: 3,
            at: SystemTime::UNIX_EPOCH,
        };
        let stopped = proc("", Phase::Stopped);
        stopped.exit.send_replace(Some(done));
        let mut c1 = Container {
            id: "c1".into(),
            guest_id: "c1".into(),
            mounts_of: None,
            bundle: PathBuf::from("/b1"),
            origin: Origin::Created,
            attachment: Attachment {
                device: "/dev/vda".into(),
                slot: Some(0),
            },
            block_volumes: Vec::new(),
            shares: Vec::new(),
            volumes: Vec::new(),
            disk_image: None,
            init: proc("", Phase::Running),
            execs: HashMap::new(),
        };
        c1.execs.insert("e1".into(), proc("e1", Phase::Running));
        c1.execs.insert("e2".into(), stopped);
        let c2 = Container {
            id: "c2".into(),
            guest_id: "c2".into(),
            mounts_of: None,
            bundle: PathBuf::from("/b2"),
            origin: Origin::Created,
            attachment: Attachment {
                device: "/dev/vdb".into(),
                slot: Some(1),
            },
            block_volumes: Vec::new(),
            shares: Vec::new(),
            volumes: Vec::new(),
            disk_image: None,
            init: proc("", Phase::Created),
            execs: HashMap::new(),
        };
        let mut containers = HashMap::from([("c1".to_string(), c1), ("c2".to_string(), c2)]);
        let mut waiter = containers
            .get_mut("c1")
            .and_then(|c| c.process("e1"))
            .map(|p| p.exit.subscribe())
            .unwrap();

        let at = SystemTime::now();
        let mut events: Vec<(String, String, u32)> = mark_all_exited(&mut containers, at, 42)
            .into_iter()
            .map(|e| {
                assert_eq!(e.pid, 42);
                (e.container_id, e.id, e.exit_status)
            })
            .collect();
        events.sort();
        assert_eq!(
            events,
            vec![
                ("c1".into(), "c1".into(), 137),
                ("c1".into(), "e1".into(), 137),
                ("c2".into(), "c2".into(), 137),
            ]
        );
        assert!(waiter.has_changed().unwrap(), "the waiter is woken");
        assert_eq!(waiter.borrow_and_update().map(|e| e.status), Some(137));
        let c1 = containers.get_mut("c1").unwrap();
        assert_eq!(c1.process("e2").unwrap().exited(), Some(done), "kept");
        assert_eq!(c1.init.phase, Phase::Stopped);
        assert!(
            mark_all_exited(&mut containers, at, 42).is_empty(),
            "reported once"
        );
    }
}
