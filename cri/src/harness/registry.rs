//! A local image registry (Debian's `docker-registry`, distribution 2.8) on
//! loopback, and busybox-static images built with umoci and pushed to it
//! with skopeo, so containerd's CRI plugin pulls them as a node would.

use super::daemon::Daemon;
use super::{run, HarnessError};
use std::fs;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// How long one image tool (umoci, skopeo) may take.
const TOOL_DEADLINE: Duration = Duration::from_secs(120);

/// Where the static busybox of Debian's `busybox-static` lives.
pub const BUSYBOX: &str = "/bin/busybox";

/// A running registry on `127.0.0.1:<port>`, plain HTTP; stopped on drop.
pub struct Registry {
    /// Held to stop the registry on drop.
    _daemon: Daemon,
    addr: SocketAddr,
}

impl Registry {
    /// Starts a registry storing its blobs under `dir`.
    pub fn start(dir: &Path) -> Result<Registry, HarnessError> {
        let mut last = None;
        // The port is picked by binding port 0 and released before the
        // registry binds it: another process may take it in between, so
        // a start that loses that race is retried.
        for attempt in 0..3 {
            let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .and_then(|l| l.local_addr())
                .map_err(|e| HarnessError::io("picking a free loopback port".into(), e))?
                .port();
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            let config = dir.join("registry.yml");
            let storage = dir.join("storage");
            fs::create_dir_all(&storage)
                .map_err(|e| HarnessError::io(format!("creating {}", storage.display()), e))?;
            fs::write(
                &config,
                format!(
                    "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
                    storage.display()
                ),
            )
            .map_err(|e| HarnessError::io(format!("writing {}", config.display()), e))?;
            let mut daemon = Daemon::spawn(
                "docker-registry",
                Command::new("docker-registry").arg("serve").arg(&config),
                &dir.join(format!("registry-{attempt}.log")),
            )?;
            match daemon.wait_until("listening socket", Duration::from_secs(30), || {
                TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            }) {
                Ok(()) => {
                    return Ok(Registry {
                        _daemon: daemon,
                        addr,
                    })
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(HarnessError::Startup {
            name: "docker-registry".into(),
            detail: "never started".into(),
        }))
    }

    /// `127.0.0.1:<port>`: the registry host in image references.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// Pushes the image `tag` of the OCI layout `layout` as
    /// `<host>/twig/<name>:v1`; returns that reference.
    pub fn push(&self, layout: &Path, tag: &str, name: &str) -> Result<String, HarnessError> {
        let reference = format!("{}/twig/{name}:v1", self.host());
        run(
            Command::new("skopeo")
                .args(["copy", "--quiet", "--dest-tls-verify=false"])
                .arg(format!("oci:{}:{tag}", layout.display()))
                .arg(format!("docker://{reference}")),
            TOOL_DEADLINE,
        )?;
        Ok(reference)
    }
}

/// Builds images in one OCI layout: a base layer of busybox-static (every
/// applet linked in `/bin`), and images on top of it.
pub struct ImageBuilder {
    layout: PathBuf,
    work: PathBuf,
}

impl ImageBuilder {
    /// Creates the layout under `dir` and its `base` image.
    pub fn new(dir: &Path) -> Result<ImageBuilder, HarnessError> {
        let busybox =
            fs::read(BUSYBOX).map_err(|e| HarnessError::io(format!("reading {BUSYBOX}"), e))?;
        if !is_static_elf(&busybox) {
            return Err(HarnessError::Missing(vec![format!(
                "a static {BUSYBOX} (Debian's busybox-static, not busybox)"
            )]));
        }
        let builder = ImageBuilder {
            layout: dir.join("layout"),
            work: dir.to_path_buf(),
        };
        umoci(&["init", "--layout"], Some(&builder.layout))?;
        umoci(&["new", "--image", &builder.tag("base")], None)?;
        builder.add_layer("base", |rootfs| {
            let bin = rootfs.join("bin");
            fs::create_dir_all(&bin)?;
            for d in ["tmp", "etc", "proc", "sys", "dev"] {
                fs::create_dir_all(rootfs.join(d))?;
            }
            fs::set_permissions(rootfs.join("tmp"), fs::Permissions::from_mode(0o1777))?;
            fs::write(bin.join("busybox"), &busybox)?;
            fs::set_permissions(bin.join("busybox"), fs::Permissions::from_mode(0o755))?;
            let list = Command::new(BUSYBOX).arg("--list").output()?;
            for applet in String::from_utf8_lossy(&list.stdout).lines() {
                if applet != "busybox" && !applet.contains('/') && !applet.is_empty() {
                    symlink("busybox", bin.join(applet))?;
                }
            }
            Ok(())
        })?;
        umoci(
            &[
                "config",
                "--image",
                &builder.tag("base"),
                "--config.env",
                "PATH=/bin",
            ],
            None,
        )?;
        Ok(builder)
    }

    /// The OCI layout directory.
    pub fn layout(&self) -> &Path {
        &self.layout
    }

    /// An image `name`: the base plus a layer with `files` (path in the
    /// rootfs, content), running `cmd`.
    pub fn image(
        &self,
        name: &str,
        files: &[(&str, &[u8])],
        cmd: &[&str],
    ) -> Result<(), HarnessError> {
        umoci(&["tag", "--image", &self.tag("base"), name], None)?;
        if !files.is_empty() {
            self.add_layer(name, |rootfs| {
                for (path, content) in files {
                    let dest = rootfs.join(path.trim_start_matches('/'));
                    if let Some(parent) = dest.parent() {
                        fs::create_dir_all(parent)?;
                    }
                    fs::write(dest, content)?;
                }
                Ok(())
            })?;
        }
        let mut args = vec!["config", "--image"];
        let tag = self.tag(name);
        args.push(&tag);
        for c in cmd {
            args.extend(["--config.cmd", c]);
        }
        umoci(&args, None)
    }

    fn tag(&self, name: &str) -> String {
        format!("{}:{name}", self.layout.display())
    }

    /// Unpacks image `name`, lets `change` edit its rootfs, repacks.
    fn add_layer(
        &self,
        name: &str,
        change: impl FnOnce(&Path) -> std::io::Result<()>,
    ) -> Result<(), HarnessError> {
        let bundle = self.work.join(format!("bundle-{name}"));
        let tag = self.tag(name);
        umoci(&["unpack", "--image", &tag], Some(&bundle))?;
        change(&bundle.join("rootfs"))
            .map_err(|e| HarnessError::io(format!("writing the rootfs of image {name}"), e))?;
        umoci(&["repack", "--image", &tag], Some(&bundle))?;
        fs::remove_dir_all(&bundle)
            .map_err(|e| HarnessError::io(format!("removing {}", bundle.display()), e))
    }
}

fn umoci(args: &[&str], path: Option<&Path>) -> Result<(), HarnessError> {
    let mut cmd = Command::new("umoci");
    cmd.args(args);
    if let Some(p) = path {
        cmd.arg(p);
    }
    run(&mut cmd, TOOL_DEADLINE).map(drop)
}

/// A 64-bit ELF without a PT_INTERP program header: runs in an image that
/// has no libc.
fn is_static_elf(elf: &[u8]) -> bool {
    let u16_at = |o: usize| {
        elf.get(o..o + 2)
            .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))
    };
    let u64_at = |o: usize| {
        elf.get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .and_then(|b| usize::try_from(u64::from_le_bytes(b)).ok())
    };
    if elf.get(..5) != Some(b"\x7fELF\x02") {
        return false;
    }
    let (Some(phoff), Some(entsize), Some(num)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return false;
    };
    (0..num).all(|i| {
        let o = phoff.saturating_add(i.saturating_mul(entsize));
        elf.get(o..o.saturating_add(4)) != Some(&3u32.to_le_bytes()[..])
    })
}
