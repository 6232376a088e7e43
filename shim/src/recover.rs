//! What the shim does when the pod's VM ends without being asked to (the
//! VMM crashed, was `kill -9`ed, OOM-killed, or the shim killed it because
//! its guest stopped answering): every process of the pod is gone with it.
//! Like runc's shim for a container whose init something outside
//! SIGKILLed, each is reported exited with 128 + SIGKILL (137), and one
//! TaskExit per process tells containerd, so `ctr task ls` shows STOPPED
//! and `delete` works.

use std::collections::HashMap;
use std::time::SystemTime;

use containerd_shim_protos::events::task::TaskExit;

use crate::process::{timestamp, Container, Exited, Phase, Proc};

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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::process::Origin;
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
            bundle: PathBuf::from("/b1"),
            origin: Origin::Created,
            attachment: Attachment {
                device: "/dev/vda".into(),
                slot: Some(0),
            },
            init: proc("", Phase::Running),
            execs: HashMap::new(),
        };
        c1.execs.insert("e1".into(), proc("e1", Phase::Running));
        c1.execs.insert("e2".into(), stopped);
        let c2 = Container {
            id: "c2".into(),
            guest_id: "c2".into(),
            bundle: PathBuf::from("/b2"),
            origin: Origin::Created,
            attachment: Attachment {
                device: "/dev/vdb".into(),
                slot: Some(1),
            },
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
