//! The real helm and kubectl of the tests (see `scripts/kube-tools.sh`).
//!
//! `TWIG_KUBE_TOOLS` names the directory holding both (`scripts/test.sh`
//! exports it); without it the tests run the script themselves, which
//! downloads the tools once and prints where they are. A missing tool fails
//! the test: it never skips.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = match std::env::var_os("TWIG_KUBE_TOOLS") {
            Some(dir) => PathBuf::from(dir),
            None => {
                let script =
                    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/kube-tools.sh");
                let out = Command::new(&script)
                    .stderr(std::process::Stdio::inherit())
                    .output()
                    .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
                assert!(
                    out.status.success(),
                    "{} failed ({}); it installs helm and kubectl",
                    script.display(),
                    out.status
                );
                PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            }
        };
        for tool in ["helm", "kubectl"] {
            assert!(
                dir.join(tool).is_file(),
                "{} has no {tool}; run scripts/kube-tools.sh (TWIG_KUBE_TOOLS names its output)",
                dir.display()
            );
        }
        dir
    })
}

/// The real `helm` binary.
pub fn helm() -> PathBuf {
    bin_dir().join("helm")
}

/// The real `kubectl` binary.
pub fn kubectl() -> PathBuf {
    bin_dir().join("kubectl")
}

/// Runs `command`, failing the test with its output when it does not succeed.
pub fn succeed(command: &mut Command) -> String {
    let out = run(command);
    assert!(
        out.status.success(),
        "{command:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `command` to its end; the test judges the outcome.
pub fn run(command: &mut Command) -> Output {
    command
        .output()
        .unwrap_or_else(|e| panic!("running {command:?}: {e}"))
}

/// A real kubectl configured for one test API server (its own kubeconfig
/// and discovery cache, removed with it).
pub struct Kubectl {
    dir: tempfile::TempDir,
}

impl Kubectl {
    /// A kubectl talking plain HTTP to `server` (`127.0.0.1:port`), namespace `default`.
    pub fn new(server: std::net::SocketAddr) -> Self {
        let dir = tempfile::tempdir().expect("kubectl dir");
        let config = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: test, cluster: {{server: \"http://{server}\"}}}}]\n\
             users: [{{name: test, user: {{}}}}]\n\
             contexts: [{{name: test, context: {{cluster: test, user: test, namespace: default}}}}]\n\
             current-context: test\n"
        );
        std::fs::write(dir.path().join("kubeconfig"), config).expect("write kubeconfig");
        Self { dir }
    }

    /// The kubeconfig file this kubectl uses (for other clients of the same server,
    /// such as kubectl plugins, which take no flag before their name).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// `kubectl <args>`, not yet started.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(kubectl());
        command
            .env("KUBECONFIG", self.kubeconfig())
            .arg("--cache-dir")
            .arg(self.dir.path().join("cache"))
            .args(args);
        command
    }

    /// Runs `kubectl <args>` to its end (off the async runtime, which serves the API).
    pub async fn run(&self, args: &[&str]) -> Output {
        let mut command = self.command(args);
        tokio::task::spawn_blocking(move || run(&mut command))
            .await
            .expect("kubectl task")
    }

    /// Runs `kubectl <args>`, failing the test unless it succeeds; its stdout.
    pub async fn ok(&self, args: &[&str]) -> String {
        let mut command = self.command(args);
        tokio::task::spawn_blocking(move || succeed(&mut command))
            .await
            .expect("kubectl task")
    }
}
