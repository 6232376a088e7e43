//! Helpers shared by the shim's host tests: a real twig-agent on the host,
//! bundles with busybox rootfs images, ttrpc contexts and codes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use containerd_shim_protos::api;
use containerd_shim_protos::ttrpc::context::Context;
use containerd_shim_protos::ttrpc::{self, Code};

pub const T: Duration = Duration::from_secs(30);

pub fn agent_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TWIG_AGENT_BIN") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = twig_store::testkit::clear_cargo_test_env(&mut Command::new(cargo))
        .current_dir(&root)
        // Every binary, with the workspace's features: see node_daemon.rs.
        .args(["build", "-q", "--workspace", "--bins"])
        .status()
        .expect("running cargo build --workspace --bins");
    assert!(st.success(), "building twig-agent failed");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or(root.join("target"));
    target.join("debug/twig-agent")
}

/// The agent in its own pid + mount namespaces; killed (with every
/// container process) on drop.
pub struct Agent {
    child: Child,
    /// The agent's socket.
    pub socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    pub fn start() -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let state = dir.path().join("state");
        let script = format!(
            "exec {} --listen unix://{} --state-dir {}",
            agent_binary().display(),
            socket.display(),
            state.display()
        );
        let child = Command::new("unshare")
            .args([
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                "sh",
                "-c",
                &script,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("agent.log")).unwrap())
            .spawn()
            .unwrap();
        Agent {
            child,
            socket,
            _dir: dir,
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn ctx() -> Context {
    Context {
        timeout_nano: 60_000_000_000,
        ..Default::default()
    }
}

/// A bundle with `config.json` and a busybox rootfs image.
pub fn bundle(
    dir: &Path,
    name: &str,
    args: &[&str],
    extra: serde_json::Value,
) -> (PathBuf, PathBuf) {
    let b = dir.join(name);
    std::fs::create_dir_all(&b).unwrap();
    std::fs::write(
        b.join("config.json"),
        twig_agent::testkit::spec(args, extra),
    )
    .unwrap();
    let img = b.join("rootfs.img");
    twig_agent::testkit::busybox_rootfs(&img, 16, &[]).unwrap();
    (b, img)
}

pub fn twig_mount(img: &Path) -> api::Mount {
    api::Mount {
        type_: "ext4".into(),
        source: img.display().to_string(),
        options: vec!["rw".into(), "loop".into()],
        ..Default::default()
    }
}

pub fn code(e: ttrpc::Error) -> Code {
    match e {
        ttrpc::Error::RpcStatus(s) => s.code(),
        other => panic!("not a status: {other:?}"),
    }
}
