//! What the plugin's test binaries share: kubectl with `kubectl-twig` on its
//! PATH, and how a run ended. Each test binary uses part of it.
#![allow(dead_code)]

use std::process::{Command, Output};

use twig_controller_testkit::apiserver::TestApiServer;
use twig_controller_testkit::kube_tools::{kubectl, Kubectl};

/// kubectl with `kubectl-twig` on its PATH, for one test API server.
pub struct Plugin {
    /// kubectl for the server, and its kubeconfig.
    pub kubectl: Kubectl,
    /// The directory holding the plugin, first on kubectl's PATH.
    pub path: tempfile::TempDir,
}

impl Plugin {
    /// kubectl for `server`, with the plugin on PATH.
    pub fn new(server: &TestApiServer) -> Self {
        let path = tempfile::tempdir().expect("plugin dir");
        std::os::unix::fs::symlink(
            env!("CARGO_BIN_EXE_kubectl-twig"),
            path.path().join("kubectl-twig"),
        )
        .expect("link the plugin");
        Self {
            kubectl: Kubectl::new(server.addr),
            path,
        }
    }

    /// `kubectl twig <args>` (no flag may come before `twig`: kubectl's rule for plugins).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = self.kubectl_command();
        command.arg("twig").args(args);
        command
    }

    /// kubectl with the plugin's directory first on PATH.
    pub fn kubectl_command(&self) -> Command {
        let mut command = Command::new(kubectl());
        let system_path = std::env::var("PATH").unwrap_or_default();
        command.env("KUBECONFIG", self.kubectl.kubeconfig()).env(
            "PATH",
            format!("{}:{system_path}", self.path.path().display()),
        );
        command
    }

    /// Runs `kubectl twig <args>` to its end, off the runtime that serves the API.
    pub async fn run(&self, args: &[&str]) -> Run {
        self.start(args).await_output().await
    }

    /// Starts `kubectl twig <args>`; `await_output` collects it.
    pub fn start(&self, args: &[&str]) -> Started {
        let mut command = self.command(args);
        Started(tokio::task::spawn_blocking(move || {
            command.output().expect("run kubectl")
        }))
    }

    /// Runs it, failing the test unless it succeeds; its stdout.
    pub async fn ok(&self, args: &[&str]) -> String {
        let run = self.run(args).await;
        assert!(run.success(), "kubectl twig {args:?} failed:\n{run:?}");
        run.stdout
    }
}

/// A `kubectl twig` still running.
pub struct Started(tokio::task::JoinHandle<Output>);

impl Started {
    pub async fn await_output(self) -> Run {
        let out = self.0.await.expect("kubectl task");
        Run {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

/// How a `kubectl twig` run ended.
#[derive(Debug)]
pub struct Run {
    /// The exit code.
    pub code: Option<i32>,
    /// What it printed.
    pub stdout: String,
    /// What it printed on stderr.
    pub stderr: String,
}

impl Run {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// Failed as kubectl fails: exit 1, one `error: …` (or `Error from server …`) line.
    pub fn assert_error(&self, expected: &str) {
        assert_eq!(self.code, Some(1), "{self:?}");
        assert!(
            self.stderr.starts_with("error: ") || self.stderr.starts_with("Error from server ("),
            "not kubectl's error format: {self:?}"
        );
        assert!(
            self.stderr.contains(expected),
            "no {expected:?} in {self:?}"
        );
    }

    /// The server's NotFound for `resource` `name`, as kubectl prints it (the
    /// test server spells the resource with its version: `pods.v1`).
    pub fn assert_not_found(&self, resource: &str, name: &str) {
        self.assert_error(&format!("Error from server (NotFound): {resource}"));
        self.assert_error(&format!("\"{name}\" not found"));
    }
}
