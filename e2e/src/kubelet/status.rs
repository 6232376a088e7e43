//! A pod's status as kubelet reports it (`pkg/kubelet/kubelet_pods.go`,
//! `convertToAPIContainerStatuses`; `pkg/kubelet/kuberuntime`): each
//! container's state from CRI (`terminated` with its exit code, CRI's
//! reason — `Completed`, `Error`, `OOMKilled` — start and finish times and
//! the termination message), the previous instance in `lastState`,
//! `restartCount`; the pod's conditions with their transition times kept
//! while they hold.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    PodCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use twig_cri::api;

/// The most of a termination message file kubelet reads (its tail).
pub const MAX_TERMINATION_MESSAGE: u64 = 4096;
/// The most log lines `FallbackToLogsOnError` takes.
const MAX_LOG_LINES: usize = 80;
/// The most log bytes `FallbackToLogsOnError` takes (their tail).
const MAX_LOG_BYTES: usize = 2048;

/// The last `max` bytes of `path`; `None` when it does not exist.
fn tail(path: &Path, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(max)))?;
    let mut data = Vec::new();
    file.read_to_end(&mut data)?;
    Ok(Some(data))
}

/// The termination message of an exited container as kubelet's
/// `getTerminationMessage` and `readLastStringFromContainerLogs` make it:
/// the tail of the file mounted at `terminationMessagePath` (`message_file`),
/// or, with `FallbackToLogsOnError`, a non-zero exit and no message, the
/// last 80 lines (2048 bytes) of the container's CRI log.
pub fn termination_message(
    message_file: Option<&Path>,
    fallback_to_logs: bool,
    exit_code: i32,
    log: &Path,
) -> String {
    let fallback = fallback_to_logs && exit_code != 0;
    let (message, check_logs) = match message_file.map(|p| (p, tail(p, MAX_TERMINATION_MESSAGE))) {
        None | Some((_, Ok(None))) => (String::new(), fallback),
        Some((_, Ok(Some(data)))) => {
            let empty = data.is_empty();
            (
                String::from_utf8_lossy(&data).into_owned(),
                fallback && empty,
            )
        }
        Some((p, Err(e))) => (
            format!("Error on reading termination log {}: {e}", p.display()),
            false,
        ),
    };
    if !check_logs {
        return message;
    }
    let lines = twig_cri::logs::read(log);
    let start = lines.len().saturating_sub(MAX_LOG_LINES);
    let text: String = lines[start..]
        .iter()
        .map(|l| format!("{}\n", l.text))
        .collect();
    let cut = text.len().saturating_sub(MAX_LOG_BYTES);
    let cut = (cut..=text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(text.len());
    text[cut..].to_string()
}

/// A CRI time (nanoseconds since the epoch) as an API time; `None` for 0.
pub fn time(nanos: i64) -> Option<Time> {
    (nanos > 0)
        .then(|| Timestamp::from_second(nanos / 1_000_000_000).ok())
        .flatten()
        .map(Time)
}

/// The `terminated` state of an exited CRI container, with `message`.
pub fn terminated(status: &api::ContainerStatus, message: String) -> ContainerStateTerminated {
    let reason = if !status.reason.is_empty() {
        status.reason.clone()
    } else if status.exit_code == 0 {
        "Completed".into()
    } else {
        "Error".into()
    };
    let message = match (status.message.is_empty(), message.is_empty()) {
        (_, true) => status.message.clone(),
        (true, false) => message,
        (false, false) => format!("{}: {message}", status.message),
    };
    ContainerStateTerminated {
        container_id: Some(format!("{}{}", super::CONTAINER_ID_PREFIX, status.id)),
        exit_code: status.exit_code,
        reason: Some(reason),
        message: (!message.is_empty()).then_some(message),
        started_at: time(status.started_at),
        finished_at: time(status.finished_at),
        signal: None,
    }
}

/// A container's API state.
pub fn state(
    running_since: Option<i64>,
    terminated: Option<ContainerStateTerminated>,
    waiting: Option<(&str, &str)>,
) -> ContainerState {
    if let Some(t) = terminated {
        return ContainerState {
            terminated: Some(t),
            ..Default::default()
        };
    }
    if let Some(since) = running_since {
        return ContainerState {
            running: Some(ContainerStateRunning {
                started_at: time(since),
            }),
            ..Default::default()
        };
    }
    let (reason, message) = waiting.unwrap_or(("ContainerCreating", ""));
    ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.into()),
            message: (!message.is_empty()).then(|| message.to_string()),
        }),
        ..Default::default()
    }
}

/// The pod's conditions, each keeping its transition time while its value
/// holds.
#[derive(Debug, Default)]
pub struct Conditions {
    current: BTreeMap<&'static str, (bool, Option<String>, Time)>,
}

impl Conditions {
    /// Sets condition `type_` (with a reason when false).
    pub fn set(&mut self, type_: &'static str, value: bool, reason: Option<&str>) {
        let reason = reason.map(String::from);
        match self.current.get_mut(type_) {
            Some((v, r, _)) if *v == value => *r = reason,
            _ => {
                self.current
                    .insert(type_, (value, reason, Time(Timestamp::now())));
            }
        }
    }

    /// The conditions in kubelet's order.
    pub fn list(&self) -> Vec<PodCondition> {
        [
            "PodReadyToStartContainers",
            "Initialized",
            "Ready",
            "ContainersReady",
            "PodScheduled",
        ]
        .into_iter()
        .filter_map(|t| {
            let (value, reason, at) = self.current.get(t)?;
            Some(PodCondition {
                type_: t.into(),
                status: if *value { "True" } else { "False" }.into(),
                reason: reason.clone(),
                last_transition_time: Some(at.clone()),
                ..Default::default()
            })
        })
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_file_tail_is_the_message() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("msg");
        let log = dir.path().join("0.log");
        std::fs::write(&file, format!("{}END", "x".repeat(5000))).unwrap_or_else(|e| panic!("{e}"));
        let m = termination_message(Some(&file), false, 1, &log);
        assert_eq!(m.len(), 4096);
        assert!(m.ends_with("END"));
    }

    #[test]
    fn fallback_to_logs_only_on_error_with_an_empty_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("msg");
        let log = dir.path().join("0.log");
        std::fs::write(&file, "").unwrap_or_else(|e| panic!("{e}"));
        let lines: String = (0..100)
            .map(|i| format!("2024-01-01T00:00:00Z stderr F line {i}\n"))
            .collect();
        std::fs::write(&log, lines).unwrap_or_else(|e| panic!("{e}"));
        let m = termination_message(Some(&file), true, 1, &log);
        assert!(
            m.starts_with("line 20\n") && m.ends_with("line 99\n"),
            "{m}"
        );
        assert_eq!(termination_message(Some(&file), true, 0, &log), "");
        assert_eq!(termination_message(Some(&file), false, 1, &log), "");
        std::fs::write(&file, "bye").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(termination_message(Some(&file), true, 1, &log), "bye");
    }

    #[test]
    fn terminated_states_carry_cris_reason_or_kubelets_default() {
        let status = api::ContainerStatus {
            id: "abc".into(),
            exit_code: 0,
            started_at: 2_000_000_000,
            finished_at: 3_000_000_000,
            ..Default::default()
        };
        let t = terminated(&status, "done".into());
        assert_eq!(t.reason.as_deref(), Some("Completed"));
        assert_eq!(t.message.as_deref(), Some("done"));
        assert_eq!(t.container_id.as_deref(), Some("containerd://abc"));
        assert_eq!(t.finished_at.map(|t| t.0.as_second()), Some(3));
        let oom = api::ContainerStatus {
            exit_code: 137,
            reason: "OOMKilled".into(),
            ..Default::default()
        };
        assert_eq!(
            terminated(&oom, String::new()).reason.as_deref(),
            Some("OOMKilled")
        );
        let err = api::ContainerStatus {
            exit_code: 3,
            ..Default::default()
        };
        assert_eq!(
            terminated(&err, String::new()).reason.as_deref(),
            Some("Error")
        );
    }

    #[test]
    fn conditions_keep_their_transition_time_while_they_hold() {
        let mut c = Conditions::default();
        c.set("Ready", false, Some("ContainersNotReady"));
        let first = c.list()[0].last_transition_time.clone();
        c.set("Ready", false, Some("ContainersNotReady"));
        assert_eq!(c.list()[0].last_transition_time, first);
        c.set("PodScheduled", true, None);
        let types: Vec<String> = c.list().into_iter().map(|c| c.type_).collect();
        assert_eq!(types, ["Ready", "PodScheduled"]);
    }
}
