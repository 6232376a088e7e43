//! containerd with its CRI plugin, all of its state under one directory:
//! root, state, sockets, CNI config, runc's state. Stopped by PID.

use super::daemon::Daemon;
use super::HarnessError;
use std::fmt::Write as _;
use std::fs;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Debian's CNI plugins (`containernetworking-plugins`).
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// containerd's runc shim v2: the handler every harness offers.
pub const RUNC_RUNTIME_TYPE: &str = "io.containerd.runc.v2";

/// A CRI runtime handler: the name `RunPodSandbox` asks for and the
/// containerd shim that serves it.
///
/// This is where Twig's shim plugs in: a handler `twig` with runtime type
/// `io.containerd.twig.v2`, its `containerd-shim-twig-v2` binary on
/// containerd's PATH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeHandler {
    /// The handler name (a RuntimeClass's `handler`), e.g. `runc`.
    pub name: String,
    /// The containerd runtime type, e.g. `io.containerd.runc.v2`.
    pub runtime_type: String,
}

impl RuntimeHandler {
    /// `runc`, served by `io.containerd.runc.v2`.
    pub fn runc() -> RuntimeHandler {
        RuntimeHandler {
            name: "runc".into(),
            runtime_type: RUNC_RUNTIME_TYPE.into(),
        }
    }

    /// Parses `name` (runc's shim) or `name=runtime_type`.
    pub fn parse(s: &str) -> Result<RuntimeHandler, String> {
        let (name, runtime_type) = s.split_once('=').unwrap_or((s, RUNC_RUNTIME_TYPE));
        let valid = |x: &str| {
            !x.is_empty()
                && x.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if !valid(name) || !valid(runtime_type) {
            return Err(format!(
                "runtime handler {s:?}: expected NAME or NAME=RUNTIME_TYPE (letters, digits, '-', '_', '.')"
            ));
        }
        Ok(RuntimeHandler {
            name: name.into(),
            runtime_type: runtime_type.into(),
        })
    }
}

/// What the CRI plugin is configured with.
pub(crate) struct CriSettings<'a> {
    pub sandbox_image: &'a str,
    pub registry_host: &'a str,
    pub cni_conf_dir: &'a Path,
    pub runtimes: &'a [RuntimeHandler],
}

/// A running containerd; its socket answers CRI.
pub struct Containerd {
    pub(crate) daemon: Daemon,
    socket: PathBuf,
    runc_root: PathBuf,
}

impl Containerd {
    /// Writes the config under `dir` and starts containerd on it.
    pub(crate) fn start(dir: &Path, cri: &CriSettings<'_>) -> Result<Containerd, HarnessError> {
        fs::create_dir_all(dir)
            .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
        let socket = dir.join("containerd.sock");
        let runc_root = dir.join("runc");
        let config = dir.join("containerd.toml");
        fs::write(&config, config_toml(dir, &socket, &runc_root, cri))
            .map_err(|e| HarnessError::io(format!("writing {}", config.display()), e))?;
        let mut daemon = Daemon::spawn(
            "containerd",
            Command::new("containerd").arg("--config").arg(&config),
            &dir.join("containerd.log"),
        )?;
        daemon.wait_until("CRI socket", Duration::from_secs(60), || {
            UnixStream::connect(&socket).is_ok()
        })?;
        Ok(Containerd {
            daemon,
            socket,
            runc_root,
        })
    }

    /// containerd's gRPC socket (CRI and containerd's own API).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The `--root` of runc for every runc-type handler.
    pub fn runc_root(&self) -> &Path {
        &self.runc_root
    }

    /// containerd's log so far.
    pub fn log_text(&self) -> String {
        self.daemon.log_text()
    }
}

/// containerd's config: every path under `dir`, so that harnesses and the
/// node's own containerd never share state, sockets or ports.
fn config_toml(dir: &Path, socket: &Path, runc_root: &Path, cri: &CriSettings<'_>) -> String {
    let cri_plugin = r#"plugins."io.containerd.grpc.v1.cri""#;
    let mut s = format!(
        r#"version = 2
root = "{root}"
state = "{state}"

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"

[{cri_plugin}]
  sandbox_image = "{sandbox_image}"
  # Without these two, runc's sandbox create dies on this machine ("can't
  # get final child's PID from pipe").
  disable_apparmor = true
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri_plugin}.cni]
  bin_dir = "{cni_bin}"
  conf_dir = "{cni_conf}"
  max_conf_num = 1

[{cri_plugin}.registry.mirrors."{host}"]
  endpoint = ["http://{host}"]

[{cri_plugin}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
"#,
        root = dir.join("root").display(),
        state = dir.join("state").display(),
        socket = socket.display(),
        opt = dir.join("opt").display(),
        sandbox_image = cri.sandbox_image,
        cni_bin = CNI_BIN_DIR,
        cni_conf = cri.cni_conf_dir.display(),
        host = cri.registry_host,
    );
    for rt in cri.runtimes {
        let _ = write!(
            s,
            "\n[{cri_plugin}.containerd.runtimes.\"{name}\"]\n  runtime_type = \"{ty}\"\n",
            name = rt.name,
            ty = rt.runtime_type,
        );
        if rt.runtime_type == RUNC_RUNTIME_TYPE {
            // runc's state in our directory, not /run/containerd/runc:
            // leftovers can then be found and killed by this harness alone.
            let _ = write!(
                s,
                "[{cri_plugin}.containerd.runtimes.\"{name}\".options]\n  Root = \"{root}\"\n",
                name = rt.name,
                root = runc_root.display(),
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_parse() {
        assert_eq!(RuntimeHandler::parse("runc"), Ok(RuntimeHandler::runc()));
        assert_eq!(
            RuntimeHandler::parse("twig=io.containerd.twig.v2"),
            Ok(RuntimeHandler {
                name: "twig".into(),
                runtime_type: "io.containerd.twig.v2".into()
            })
        );
        for bad in ["", "=x", "a=", "a b", "a\"=x", "a=b]"] {
            assert!(RuntimeHandler::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn config_names_every_handler_and_keeps_runc_state_local() {
        let dir = Path::new("/h");
        let runtimes = [
            RuntimeHandler::runc(),
            RuntimeHandler::parse("twig=io.containerd.twig.v2").unwrap_or_else(|e| panic!("{e}")),
        ];
        let toml = config_toml(
            dir,
            &dir.join("c.sock"),
            &dir.join("runc"),
            &CriSettings {
                sandbox_image: "127.0.0.1:5000/twig/pause:v1",
                registry_host: "127.0.0.1:5000",
                cni_conf_dir: &dir.join("net.d"),
                runtimes: &runtimes,
            },
        );
        assert!(toml.contains("runtimes.\"runc\"]\n  runtime_type = \"io.containerd.runc.v2\""));
        assert!(toml.contains("runtimes.\"runc\".options]\n  Root = \"/h/runc\""));
        assert!(toml.contains("runtimes.\"twig\"]\n  runtime_type = \"io.containerd.twig.v2\""));
        assert!(!toml.contains("runtimes.\"twig\".options"));
        assert!(toml.contains("endpoint = [\"http://127.0.0.1:5000\"]"));
        assert!(toml.contains("disable_apparmor = true"));
    }
}
