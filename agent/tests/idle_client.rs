//! An idle connection to the agent costs its client nothing: every shim of
//! a node holds one for as long as its pod runs, so a thread that wakes on
//! a timer per connection is a node's CPUs woken per pod (ttrpc's sync
//! client polls its socket every 10 ms: 100 wake-ups a second a pod). A
//! test binary of its own, so that no other test's threads run in this
//! process while it counts.

mod common;

use std::time::Duration;

use common::{Agent, T};

/// How long the idle client is watched.
const WINDOW: Duration = Duration::from_secs(2);
/// Wake-ups of the client's threads allowed in the window (the test's
/// own thread sleeping through it, now and then a stray one).
const MAX_WAKEUPS: u64 = 20;

/// Context switches of every thread of this process so far.
fn switches() -> u64 {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

#[test]
fn an_idle_agent_connection_wakes_no_thread_of_the_client() {
    let agent = Agent::start();
    let client = agent.client();
    client.ping(T).expect("ping");
    let before = switches();
    // A measurement window: nothing is asked of the client meanwhile.
    std::thread::sleep(WINDOW);
    let woke = switches() - before;
    assert!(
        woke <= MAX_WAKEUPS,
        "an idle client's threads woke {woke} times in {WINDOW:?} (at most {MAX_WAKEUPS})"
    );
    // The connection still serves.
    client.ping(T).expect("ping after the window");
}
