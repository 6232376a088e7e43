//! What the shim keeps about containers and their processes, and the exit
//! statuses it reports.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::SystemTime;

use containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim_protos::protobuf::MessageField;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use twig_agent::client::ProcessExit;

use crate::resources::volumes::Volume;
use crate::sandbox::Attachment;
use crate::stdio::{OpenedStdio, StdioPaths};

/// How a container came to be in the VM. Restore-from (a VM restored from
/// a pod snapshot) will *adopt* containers whose processes already run in
/// the guest instead of creating them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Created by the shim through the agent.
    Created,
    /// Found running in a restored VM and adopted.
    Adopted,
}

/// A process's life as containerd sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Created, not started.
    Created,
    /// Started, not exited.
    Running,
    /// Exited.
    Stopped,
}

/// How and when a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exited {
    /// As runc's shim reports it: the exit code, or 128 + the signal.
    pub status: u32,
    /// When the shim learned of it.
    pub at: SystemTime,
}

impl Exited {
    /// The exit containerd is told about for an agent's [`ProcessExit`].
    pub fn from_agent(exit: ProcessExit, at: SystemTime) -> Exited {
        Exited {
            status: exit_status(exit),
            at,
        }
    }
}

/// runc's shim reports the exit code of a process that exited and 128 +
/// the signal of one a signal killed; the agent reports the same in
/// `status` (with the signal beside it). A negative status cannot come
/// from either and is reported as 255, like a failed wait.
pub fn exit_status(exit: ProcessExit) -> u32 {
    let status = if exit.signal > 0 {
        128 + exit.signal
    } else {
        exit.status
    };
    u32::try_from(status).unwrap_or(255)
}

/// A protobuf timestamp.
pub fn timestamp(t: SystemTime) -> MessageField<Timestamp> {
    MessageField::some(Timestamp::from(t))
}

/// One process: a container's init (`exec_id` empty) or an exec.
pub struct Proc {
    /// containerd's exec id; empty for the init.
    pub exec_id: String,
    /// Its stdio as containerd named it.
    pub stdio: StdioPaths,
    /// The opened stdio, until the process starts and the copiers take it.
    pub opened: Option<OpenedStdio>,
    /// Where it is in its life.
    pub phase: Phase,
    /// Its pid inside the guest (0 before it starts).
    pub guest_pid: u32,
    /// An exec's OCI process (JSON); empty for the init.
    pub process_json: Vec<u8>,
    /// Set once, when it exits.
    pub exit: watch::Sender<Option<Exited>>,
    /// Fires containerd's CloseIO at the stdin copier.
    pub close_stdin: Option<oneshot::Sender<()>>,
    /// The stdin copier.
    pub stdin_copier: Option<JoinHandle<()>>,
}

impl Proc {
    /// A created, not yet started process.
    pub fn new(
        exec_id: &str,
        stdio: StdioPaths,
        opened: OpenedStdio,
        process_json: Vec<u8>,
    ) -> Proc {
        Proc {
            exec_id: exec_id.to_string(),
            stdio,
            opened: Some(opened),
            phase: Phase::Created,
            guest_pid: 0,
            process_json,
            exit: watch::channel(None).0,
            close_stdin: None,
            stdin_copier: None,
        }
    }

    /// Its exit, once it exited.
    pub fn exited(&self) -> Option<Exited> {
        *self.exit.borrow()
    }
}

/// One container of the pod.
pub struct Container {
    /// containerd's id.
    pub id: String,
    /// The id the guest's agent knows it by: containerd's id, or for an
    /// adopted container its id in the snapshotted pod.
    pub guest_id: String,
    /// The container name its guest volumes are named after, where it is
    /// not its own (an adopted process's mounts bind another's).
    pub mounts_of: Option<String>,
    /// Its bundle directory.
    pub bundle: PathBuf,
    /// Created by the shim, or adopted from a restored VM.
    pub origin: Origin,
    /// Its rootfs disk in the guest. The pod's sandbox container has none
    /// until a volume needs the pod's disk.
    pub attachment: Attachment,
    /// Its raw block volumes' disk slots.
    pub block_volumes: Vec<Attachment>,
    /// The servers of its shared host directories (killed with it).
    pub shares: Vec<crate::resources::share::Server>,
    /// The sandbox container's rootfs image (twig-snapshotter's): the
    /// pod's disk, attached when a disk-backed volume first needs it.
    pub disk_image: Option<PathBuf>,
    /// The guest volumes its mounts use.
    pub volumes: Vec<Volume>,
    /// The init process.
    pub init: Proc,
    /// Exec'd processes by exec id.
    pub execs: HashMap<String, Proc>,
}

impl Container {
    /// The process `exec_id` names (empty: the init).
    pub fn process(&mut self, exec_id: &str) -> Option<&mut Proc> {
        if exec_id.is_empty() {
            Some(&mut self.init)
        } else {
            self.execs.get_mut(exec_id)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    #[test]
    fn exit_statuses_are_runcs() {
        assert_eq!(
            exit_status(ProcessExit {
                status: 0,
                signal: 0,
                oom_killed: false,
            }),
            0
        );
        assert_eq!(
            exit_status(ProcessExit {
                status: 3,
                signal: 0,
                oom_killed: false,
            }),
            3
        );
        assert_eq!(
            exit_status(ProcessExit {
                status: 137,
                signal: 9,
                oom_killed: false,
            }),
            137
        );
        assert_eq!(
            exit_status(ProcessExit {
                status: 143,
                signal: 15,
                oom_killed: false,
            }),
            143
        );
        // Trust the signal when both are present.
        assert_eq!(
            exit_status(ProcessExit {
                status: 0,
                signal: 15,
                oom_killed: false,
            }),
            143
        );
        assert_eq!(
            exit_status(ProcessExit {
                status: -1,
                signal: 0,
                oom_killed: false,
            }),
            255
        );
    }

    #[test]
    fn timestamps_keep_seconds_and_nanos() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123);
        let ts = timestamp(t);
        assert_eq!(ts.seconds, 1_700_000_000);
        assert_eq!(ts.nanos, 123);
    }
}
