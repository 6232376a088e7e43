//! What to do next with a pod's containers, decided from what they are
//! doing, as kubelet's `computePodActions` decides it
//! (`pkg/kubelet/kuberuntime/kuberuntime_manager.go`): init containers one
//! at a time in order, each to exit 0 before the next starts (a sidecar —
//! an init container with `restartPolicy: Always` — only to have started,
//! and it keeps running); the app containers once every init container is
//! done; an exited container restarted as the pod's `restartPolicy` says,
//! after kubelet's crash-loop back-off (`pkg/util/flowcontrol/backoff.go`:
//! the first restart at once, then 10 s doubling to 300 s, forgotten after
//! twice the cap without a crash); a container failing its liveness or
//! startup probe killed (then restarted like any exited one). Also the
//! pod's phase (`getPhase` in `pkg/kubelet/kubelet_pods.go`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// kubelet's initial crash-loop back-off.
pub const BACKOFF_BASE: Duration = Duration::from_secs(10);
/// kubelet's longest crash-loop back-off (`MaxContainerBackOff`).
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);

/// The pod's `restartPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartPolicy {
    /// `Always` (the default).
    Always,
    /// `OnFailure`.
    OnFailure,
    /// `Never`.
    Never,
}

impl RestartPolicy {
    /// The policy a pod spec's field names.
    pub fn parse(policy: Option<&str>) -> RestartPolicy {
        match policy {
            Some("OnFailure") => RestartPolicy::OnFailure,
            Some("Never") => RestartPolicy::Never,
            _ => RestartPolicy::Always,
        }
    }

    fn restarts(self, exit_code: i32) -> bool {
        match self {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => exit_code != 0,
            RestartPolicy::Never => false,
        }
    }
}

/// Where a container instance is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Created, not started (or starting).
    Created,
    /// Running.
    Running,
    /// Exited with this code.
    Exited(i32),
}

/// What the kubelet knows of the containers of one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracked {
    /// The newest instance's state.
    pub state: RunState,
    /// When the newest instance exited.
    pub finished_at: Option<Instant>,
    /// Its startup probe passed (or it has none) while running.
    pub started: bool,
    /// Its liveness or startup probe failed: it is to be killed.
    pub unhealthy: bool,
}

/// The containers of a pod, as the decision needs them.
#[derive(Debug, Clone)]
pub struct PodShape {
    /// Init containers in order: name and whether it is a sidecar.
    pub init: Vec<(String, bool)>,
    /// App containers.
    pub app: Vec<String>,
    /// The pod's restart policy.
    pub policy: RestartPolicy,
}

/// One thing to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create and start a (new) instance of this container.
    Start(String),
    /// Wait to restart this container until then (`CrashLoopBackOff`).
    BackOff(String, Instant),
    /// Stop this running container (probe failure, or the pod is done).
    Kill(String),
}

/// The decision for one pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// What to do, in order.
    pub actions: Vec<Action>,
    /// Every init container is done (`Initialized`).
    pub initialized: bool,
    /// A regular init container failed and the pod does not restart it.
    pub init_failed: bool,
}

/// kubelet's per-container crash-loop back-off.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    entries: HashMap<String, (Duration, Instant)>,
}

impl Backoff {
    /// Back-off starting at `base`, doubling up to `max`.
    pub fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max,
            entries: HashMap::new(),
        }
    }

    fn expired(&self, last: Instant, now: Instant) -> bool {
        now.saturating_duration_since(last) > self.max * 2
    }

    /// When the back-off of `key` after an exit at `event` ends, if it has
    /// not yet (`IsInBackOffSince`).
    pub fn until(&self, key: &str, event: Instant, now: Instant) -> Option<Instant> {
        let (backoff, last) = self.entries.get(key)?;
        if self.expired(*last, now) {
            return None;
        }
        let end = event + *backoff;
        (now < end).then_some(end)
    }

    /// Records a restart after an exit at `event` (`Next`): the next
    /// back-off is the base again when the last is long past, else double.
    pub fn next(&mut self, key: &str, event: Instant) {
        let backoff = match self.entries.get(key) {
            Some((b, last)) if !self.expired(*last, event) => (*b * 2).min(self.max),
            _ => self.base,
        };
        self.entries.insert(key.to_string(), (backoff, event));
    }
}

/// Starts `name` after an exit, or backs off.
fn restart(name: &str, t: &Tracked, backoff: &mut Backoff, now: Instant) -> Action {
    let finished = t.finished_at.unwrap_or(now);
    match backoff.until(name, finished, now) {
        Some(until) => Action::BackOff(name.to_string(), until),
        None => {
            backoff.next(name, finished);
            Action::Start(name.to_string())
        }
    }
}

/// What to do next with the pod's containers, from `states` (by name; a
/// container never created is absent), at `now`.
pub fn plan(
    shape: &PodShape,
    states: &HashMap<String, Tracked>,
    backoff: &mut Backoff,
    now: Instant,
) -> Plan {
    let mut actions = Vec::new();
    // Probe failures first: the container is killed, then restarted below
    // in a later pass once it shows as exited.
    for (name, t) in states {
        if t.unhealthy && t.state == RunState::Running {
            actions.push(Action::Kill(name.clone()));
        }
    }
    let mut initialized = true;
    let mut init_failed = false;
    for (name, sidecar) in &shape.init {
        let Some(t) = states.get(name) else {
            actions.push(Action::Start(name.clone()));
            initialized = false;
            break;
        };
        match (t.state, sidecar) {
            (RunState::Running, true) if t.started => continue,
            (RunState::Created | RunState::Running, _) => {
                initialized = false;
                break;
            }
            (RunState::Exited(0), false) => continue,
            (RunState::Exited(_), true) => {
                // A sidecar restarts whatever the pod's policy.
                actions.push(restart(name, t, backoff, now));
                initialized = false;
                break;
            }
            (RunState::Exited(_), false) => {
                initialized = false;
                if shape.policy == RestartPolicy::Never {
                    init_failed = true;
                } else {
                    actions.push(restart(name, t, backoff, now));
                }
                break;
            }
        }
    }
    if initialized {
        for name in &shape.app {
            match states.get(name) {
                None => actions.push(Action::Start(name.clone())),
                Some(t) => {
                    if let RunState::Exited(code) = t.state {
                        if shape.policy.restarts(code) {
                            actions.push(restart(name, t, backoff, now));
                        }
                    }
                }
            }
        }
    }
    // A pod that is done stops its sidecars, and everything still running
    // once an init container failed for good.
    let phase = phase(shape, states, initialized, init_failed);
    if phase == "Succeeded" || phase == "Failed" {
        actions.retain(|a| matches!(a, Action::Kill(_)));
        for (name, _) in &shape.init {
            if states
                .get(name)
                .is_some_and(|t| t.state == RunState::Running)
                && !actions.contains(&Action::Kill(name.clone()))
            {
                actions.push(Action::Kill(name.clone()));
            }
        }
    }
    Plan {
        actions,
        initialized,
        init_failed,
    }
}

/// The pod's phase as kubelet's `getPhase` computes it over the app
/// containers (sidecars count with the init containers).
pub fn phase(
    shape: &PodShape,
    states: &HashMap<String, Tracked>,
    initialized: bool,
    init_failed: bool,
) -> &'static str {
    if init_failed {
        return "Failed";
    }
    if !initialized {
        return "Pending";
    }
    let (mut running, mut waiting, mut stopped, mut succeeded) = (0, 0, 0, 0);
    for name in &shape.app {
        match states.get(name).map(|t| t.state) {
            Some(RunState::Running) => running += 1,
            Some(RunState::Exited(code)) => {
                stopped += 1;
                if code == 0 {
                    succeeded += 1;
                }
            }
            Some(RunState::Created) | None => waiting += 1,
        }
    }
    if waiting > 0 {
        "Pending"
    } else if running > 0 {
        "Running"
    } else if stopped > 0 {
        match shape.policy {
            RestartPolicy::Always => "Running",
            _ if stopped == succeeded => "Succeeded",
            RestartPolicy::Never => "Failed",
            RestartPolicy::OnFailure => "Running",
        }
    } else {
        "Pending"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(init: &[(&str, bool)], app: &[&str], policy: RestartPolicy) -> PodShape {
        PodShape {
            init: init.iter().map(|(n, s)| (n.to_string(), *s)).collect(),
            app: app.iter().map(|n| n.to_string()).collect(),
            policy,
        }
    }

    fn t(state: RunState, started: bool) -> Tracked {
        Tracked {
            state,
            finished_at: matches!(state, RunState::Exited(_)).then(Instant::now),
            started,
            unhealthy: false,
        }
    }

    fn states(s: &[(&str, Tracked)]) -> HashMap<String, Tracked> {
        s.iter().map(|(n, t)| (n.to_string(), t.clone())).collect()
    }

    fn backoff() -> Backoff {
        Backoff::new(BACKOFF_BASE, BACKOFF_MAX)
    }

    fn start(n: &str) -> Action {
        Action::Start(n.into())
    }

    #[test]
    fn init_containers_run_one_at_a_time_in_order_then_the_app_containers() {
        let s = shape(
            &[("a", false), ("b", false)],
            &["app", "web"],
            RestartPolicy::Always,
        );
        let now = Instant::now();
        let mut b = backoff();
        let p = plan(&s, &states(&[]), &mut b, now);
        assert_eq!((p.actions, p.initialized), (vec![start("a")], false));
        let running = states(&[("a", t(RunState::Running, true))]);
        assert!(plan(&s, &running, &mut b, now).actions.is_empty());
        let a_done = states(&[("a", t(RunState::Exited(0), false))]);
        assert_eq!(plan(&s, &a_done, &mut b, now).actions, vec![start("b")]);
        let both = states(&[
            ("a", t(RunState::Exited(0), false)),
            ("b", t(RunState::Exited(0), false)),
        ]);
        let p = plan(&s, &both, &mut b, now);
        assert_eq!(
            (p.actions, p.initialized),
            (vec![start("app"), start("web")], true)
        );
        assert_eq!(phase(&s, &both, true, false), "Pending");
    }

    #[test]
    fn a_sidecar_must_have_started_and_keeps_running() {
        let s = shape(
            &[("proxy", true), ("setup", false)],
            &["app"],
            RestartPolicy::Never,
        );
        let now = Instant::now();
        let mut b = backoff();
        let not_started = states(&[("proxy", t(RunState::Running, false))]);
        assert!(plan(&s, &not_started, &mut b, now).actions.is_empty());
        let started = states(&[("proxy", t(RunState::Running, true))]);
        assert_eq!(
            plan(&s, &started, &mut b, now).actions,
            vec![start("setup")]
        );
        let all = states(&[
            ("proxy", t(RunState::Running, true)),
            ("setup", t(RunState::Exited(0), false)),
            ("app", t(RunState::Running, true)),
        ]);
        let p = plan(&s, &all, &mut b, now);
        assert!(p.initialized && p.actions.is_empty(), "{p:?}");
        assert_eq!(phase(&s, &all, true, false), "Running");
        // The app done under Never: the pod succeeded and its sidecar stops.
        let done = states(&[
            ("proxy", t(RunState::Running, true)),
            ("setup", t(RunState::Exited(0), false)),
            ("app", t(RunState::Exited(0), false)),
        ]);
        assert_eq!(
            plan(&s, &done, &mut b, now).actions,
            vec![Action::Kill("proxy".into())]
        );
        assert_eq!(phase(&s, &done, true, false), "Succeeded");
    }

    #[test]
    fn a_failed_init_container_is_retried_unless_the_pod_never_restarts() {
        let failed = states(&[("a", t(RunState::Exited(1), false))]);
        let now = Instant::now();
        let s = shape(&[("a", false)], &["app"], RestartPolicy::OnFailure);
        assert_eq!(
            plan(&s, &failed, &mut backoff(), now).actions,
            vec![start("a")]
        );
        let s = shape(&[("a", false)], &["app"], RestartPolicy::Never);
        let p = plan(&s, &failed, &mut backoff(), now);
        assert!(p.init_failed && p.actions.is_empty(), "{p:?}");
        assert_eq!(phase(&s, &failed, false, true), "Failed");
    }

    #[test]
    fn restart_policies_and_phases() {
        let now = Instant::now();
        let ok = states(&[("app", t(RunState::Exited(0), false))]);
        let bad = states(&[("app", t(RunState::Exited(2), false))]);
        let cases = [
            (RestartPolicy::Always, &ok, true, "Running"),
            (RestartPolicy::Always, &bad, true, "Running"),
            (RestartPolicy::OnFailure, &ok, false, "Succeeded"),
            (RestartPolicy::OnFailure, &bad, true, "Running"),
            (RestartPolicy::Never, &ok, false, "Succeeded"),
            (RestartPolicy::Never, &bad, false, "Failed"),
        ];
        for (policy, st, restarts, ph) in cases {
            let s = shape(&[], &["app"], policy);
            let p = plan(&s, st, &mut backoff(), now);
            assert_eq!(
                p.actions == vec![start("app")],
                restarts,
                "{policy:?} {st:?}"
            );
            assert_eq!(phase(&s, st, true, false), ph, "{policy:?} {st:?}");
        }
    }

    #[test]
    fn an_unhealthy_container_is_killed() {
        let s = shape(&[], &["app"], RestartPolicy::Always);
        let mut sick = t(RunState::Running, true);
        sick.unhealthy = true;
        let p = plan(
            &s,
            &states(&[("app", sick)]),
            &mut backoff(),
            Instant::now(),
        );
        assert_eq!(p.actions, vec![Action::Kill("app".into())]);
    }

    #[test]
    fn crash_loop_back_off_doubles_to_the_cap_and_is_forgotten() {
        let base = Duration::from_secs(10);
        let max = Duration::from_secs(40);
        let mut b = Backoff::new(base, max);
        let t0 = Instant::now();
        // The first restart is at once.
        assert_eq!(b.until("app", t0, t0), None);
        b.next("app", t0);
        // Then 10 s, 20 s, 40 s, 40 s after each exit.
        let mut exit = t0;
        for expected in [10, 20, 40, 40] {
            exit += Duration::from_secs(1);
            let until = b.until("app", exit, exit);
            assert_eq!(until, Some(exit + Duration::from_secs(expected)));
            let later = exit + Duration::from_secs(expected);
            assert_eq!(b.until("app", exit, later), None);
            b.next("app", exit);
            exit = later;
        }
        // Quiet for more than twice the cap: back to the base.
        let much_later = exit + max * 2 + Duration::from_secs(1);
        assert_eq!(b.until("app", much_later, much_later), None);
        b.next("app", much_later);
        assert_eq!(
            b.until("app", much_later, much_later),
            Some(much_later + base)
        );
        // The planner reports the wait.
        let s = shape(&[], &["app"], RestartPolicy::Always);
        let mut crashed = t(RunState::Exited(1), false);
        crashed.finished_at = Some(much_later);
        let p = plan(&s, &states(&[("app", crashed)]), &mut b, much_later);
        assert_eq!(
            p.actions,
            vec![Action::BackOff("app".into(), much_later + base)]
        );
    }
}
