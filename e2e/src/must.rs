//! What the `ctr`-driven tests call on a node, in the form a test wants:
//! each call that fails panics with the node's logs, and each wait has a
//! deadline.

use std::ffi::OsStr;
use std::time::Duration;

use crate::{find_on_path, Background, Node, NodeConfig, Output, Runtime};

/// Starts a node; for twig, fails loudly (never skips) when the shim is not
/// on `PATH`.
pub fn node(runtime: Runtime) -> Node {
    node_with(runtime, |_| {})
}

/// [`node`], its configuration changed by `change` first.
pub fn node_with(runtime: Runtime, change: impl FnOnce(&mut NodeConfig)) -> Node {
    if runtime == Runtime::Twig {
        assert!(
            find_on_path(Runtime::Twig.shim()).is_some(),
            "containerd-shim-twig-v2 not found in the workspace build (not on PATH); \
             tests/lab/run.sh carries it into the lab"
        );
    }
    let mut config =
        NodeConfig::from_env().unwrap_or_else(|e| panic!("the node did not start: {e}"));
    change(&mut config);
    Node::start_with(&config).unwrap_or_else(|e| panic!("the node did not start: {e}"))
}

impl Node {
    /// `ctr`, whatever its status; panics only if it cannot run.
    pub fn must_ctr<S: AsRef<OsStr>>(&self, args: &[S]) -> Output {
        self.ctr(args)
            .unwrap_or_else(|e| panic!("{e}\n{}", self.logs()))
    }

    /// `ctr` that must succeed; its stdout.
    pub fn must_ctr_ok<S: AsRef<OsStr>>(&self, args: &[S]) -> String {
        self.ctr_ok(args)
            .unwrap_or_else(|e| panic!("{e}\n{}", self.logs()))
    }

    /// The task's status in `ctr task ls` (`RUNNING`, `PAUSED`, …), `None`
    /// when it is not listed.
    pub fn task_status(&self, id: &str) -> Option<String> {
        self.must_ctr_ok(&["task", "ls"]).lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&id)).then(|| f.get(2).copied().unwrap_or_default().to_string())
        })
    }

    /// Waits (at most `within`) until the background command `bg` exits,
    /// and checks its exit code.
    pub fn expect_exit(&self, bg: Background, code: i32, what: &str, within: Duration) -> Output {
        let out = bg
            .wait(within)
            .unwrap_or_else(|e| panic!("{what} did not exit: {e}\n{}", self.logs()));
        assert_eq!(
            out.code(),
            Some(code),
            "{what}: wrong exit status ({out})\n{}",
            self.logs()
        );
        out
    }
}
