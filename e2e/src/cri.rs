//! Pods through containerd's own CRI plugin on a [`Node`], driven with
//! twig-cri's client as kubelet drives them: the pod sandbox ("pause")
//! image and the test image imported into CRI's namespace on the `twig`
//! snapshotter (no registry: the lab carries OCI archives), a CNI bridge
//! network of twig-cri's ([`NetSlot`]), and teardown of every pod through
//! CRI when dropped, so CNI releases addresses and network namespaces.

use std::ffi::OsStr;
use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use twig_cri::api;
use twig_cri::harness::{NetSlot, CNI_BIN_DIR};
use twig_cri::CriClient;

use crate::error::{io, Error, Result};
use crate::node::{bpffs_root, cni_conf_dir, mounts_under, Node, NodeConfig, NET_POOL_DIR};
use crate::require;

/// The pod sandbox image containerd's CRI plugin runs as every pod's first
/// container (`sandbox_image`): busybox whose PID 1 waits until SIGTERM.
pub const PAUSE_REF: &str = "docker.io/library/twig-e2e-pause:v1";
/// containerd's namespace of CRI's images, containers and tasks.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// Deadline of every CRI call: under the lab's TCG a twig pod's first
/// sandbox builds the base template (~18 s) and everything is 10–50×
/// slower than on a host.
pub const CALL: Duration = Duration::from_secs(300);
/// How long CRI may take to load the CNI network after it is written.
const NETWORK_READY: Duration = Duration::from_secs(60);
/// How long a dropped node's pods get to stop and go.
const TEARDOWN: Duration = Duration::from_secs(60);

/// A [`Node`] whose containerd serves CRI with a CNI bridge network.
pub struct CriNode {
    node: Node,
    net: NetSlot,
    dir: PathBuf,
}

impl CriNode {
    /// [`CriNode::start_with`] as the lab's environment says
    /// ([`NodeConfig::from_env`], and `TWIG_E2E_PAUSE_IMAGE`: an OCI
    /// archive holding [`PAUSE_REF`], which tests/lab/run.sh builds with
    /// `e2e/build-image.sh`).
    pub fn start() -> Result<CriNode> {
        CriNode::start_configured(|_| {})
    }

    /// [`CriNode::start`] with the lab's configuration changed by `f`.
    pub fn start_configured(f: impl FnOnce(&mut NodeConfig)) -> Result<CriNode> {
        let pause = std::env::var_os("TWIG_E2E_PAUSE_IMAGE")
            .map(PathBuf::from)
            .ok_or_else(|| {
                Error::Environment(format!(
                    "TWIG_E2E_PAUSE_IMAGE is not set: build the pod sandbox image with \
                     `e2e/build-image.sh OUT.tar {PAUSE_REF} /bin/sh -c 'trap \"exit 0\" TERM; \
                     while :; do sleep 3600 & wait $!; done'` and point TWIG_E2E_PAUSE_IMAGE at \
                     it, or run the tests through tests/lab/run.sh"
                ))
            })?;
        let mut config = NodeConfig::from_env()?;
        f(&mut config);
        CriNode::start_with(&config, &pause)
    }

    /// Starts a node, imports `config.image` and the pod sandbox image
    /// `pause` into CRI's namespace on the `twig` snapshotter, and writes
    /// the CNI bridge network CRI reads.
    pub fn start_with(config: &NodeConfig, pause: &Path) -> Result<CriNode> {
        require(&["ip"])?;
        for plugin in ["bridge", "host-local", "loopback"] {
            let p = Path::new(CNI_BIN_DIR).join(plugin);
            if !p.is_file() {
                return Err(Error::Missing {
                    program: p.display().to_string(),
                    hint: "containernetworking-plugins: install it with scripts/install-deps.sh"
                        .into(),
                });
            }
        }
        let net = NetSlot::acquire().map_err(|e| Error::Environment(e.to_string()))?;
        let node = Node::start_with(config)?;
        let dir = node.dir()?.to_path_buf();
        net.write_cni_config(
            &cni_conf_dir(&dir.join("containerd")),
            &dir.join("cni-ipam"),
        )
        .map_err(|e| Error::Environment(e.to_string()))?;
        let node = CriNode { node, net, dir };
        for image in [config.image.as_path(), pause] {
            node.import_image(image)?;
        }
        Ok(node)
    }

    /// Imports the OCI archive `archive` into CRI's namespace on the `twig`
    /// snapshotter, as an image pull would leave it.
    pub fn import_image(&self, archive: &Path) -> Result<()> {
        self.node.ctr_ns_ok(
            CRI_NAMESPACE,
            &[
                OsStr::new("images"),
                OsStr::new("import"),
                OsStr::new("--snapshotter"),
                OsStr::new("twig"),
                archive.as_os_str(),
            ],
        )?;
        Ok(())
    }

    /// The node under CRI.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The pod network's bridge, subnet and gateway.
    pub fn net(&self) -> &NetSlot {
        &self.net
    }

    /// A CRI client on containerd's socket (every call's deadline [`CALL`]),
    /// once CRI has loaded the CNI network.
    pub async fn client(&self) -> Result<CriClient> {
        let cri = CriClient::connect(self.node.socket())
            .await
            .map_err(|e| self.cri_error("connecting", e))?
            .with_timeout(CALL);
        let deadline = Instant::now() + NETWORK_READY;
        loop {
            if cri
                .network_ready()
                .await
                .map_err(|e| self.cri_error("asking for the runtime's status", e))?
            {
                return Ok(cri);
            }
            if Instant::now() > deadline {
                return Err(Error::Environment(format!(
                    "CRI did not load the CNI network in {} within {NETWORK_READY:?}\n{}",
                    cni_conf_dir(&self.dir.join("containerd")).display(),
                    self.node.logs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A CRI error with where it happened and the node's logs.
    pub fn cri_error(&self, what: &str, e: twig_cri::Error) -> Error {
        Error::Cri(format!("{what}: {e}\n{}", self.node.logs()))
    }

    /// A pod sandbox config named `name` whose container logs go under the
    /// node's directory.
    pub fn pod_config(&self, name: &str) -> Result<api::PodSandboxConfig> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let uid = format!(
            "{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let logs = self.dir.join("pods").join(format!("{name}-{uid}"));
        fs::create_dir_all(&logs).map_err(io(format!("creating {}", logs.display())))?;
        Ok(twig_cri::pod_sandbox_config(name, &uid, &logs))
    }

    /// Where CRI writes the log of the pod's container with `log_path`.
    pub fn container_log(pod: &api::PodSandboxConfig, log_path: &str) -> PathBuf {
        Path::new(&pod.log_directory).join(log_path)
    }

    /// The addresses host-local holds for this node's pods.
    pub fn reserved_ips(&self) -> Vec<IpAddr> {
        let dir = self.dir.join("cni-ipam").join(self.net.network_name());
        fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The `twig-vmm` processes serving this node's twig pods now (each
    /// shim records its VM's pid in its state directory; twig-node's idle
    /// pool VMMs are not among them).
    pub fn pod_vmms(&self) -> Vec<u32> {
        let Ok(dirs) = fs::read_dir(self.dir.join("shim")) else {
            return Vec::new();
        };
        dirs.flatten()
            .filter_map(|d| fs::read_to_string(d.path().join("vmm.pid")).ok())
            // The pid on the first line, the VMM's API socket on the second.
            .filter_map(|p| p.lines().next()?.trim().parse().ok())
            .collect()
    }

    /// The pids of this node's twig shims running now.
    pub fn twig_shims(&self) -> Vec<u32> {
        let dir = self.dir.to_string_lossy().into_owned();
        processes()
            .into_iter()
            .filter(|(_, argv)| {
                argv.first()
                    .is_some_and(|a| a.rsplit('/').next() == Some("containerd-shim-twig-v2"))
                    && argv.iter().any(|a| a.contains(dir.as_str()))
            })
            .map(|(pid, _)| pid)
            .collect()
    }

    /// The CNI network namespaces mounted now (`…/netns/cni-…`).
    pub fn cni_netns() -> Vec<PathBuf> {
        let table = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut found: Vec<PathBuf> = table
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| m.contains("/netns/cni-"))
            .map(PathBuf::from)
            .collect();
        found.sort();
        found.dedup();
        found
    }

    /// The pods' network paths the node's twig shims have pinned now (one
    /// directory per pod under the shims' bpffs root; the node daemon's pool
    /// of prepared sets there is no pod's).
    pub fn pinned_pod_networks(&self) -> Vec<PathBuf> {
        fs::read_dir(bpffs_root(&self.dir))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name() != NET_POOL_DIR)
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits (at most `within`, polling) until [`CriNode::leftovers`] of
    /// `vmms` is empty; panics with what stayed and the node's logs. `what`
    /// says after what (for the message).
    pub async fn expect_nothing_left(&self, vmms: &[u32], within: Duration, what: &str) {
        let deadline = Instant::now() + within;
        loop {
            let left = self.leftovers(vmms);
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "left behind {within:?} after {what}: {left:#?}\n{}",
                self.node.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What a removed pod may have left behind on this node: shims naming
    /// the node's directory, the pods' VMMs `vmms` (from
    /// [`CriNode::pod_vmms`] while they ran), mounts under the node's
    /// directory, CNI network namespaces, pinned pod network paths (eBPF
    /// programs and maps; the VM's tap lives in the pod's namespace and
    /// goes with it). Empty when nothing is left.
    pub fn leftovers(&self, vmms: &[u32]) -> Vec<String> {
        let dir = self.dir.to_string_lossy().into_owned();
        let mut found: Vec<String> = processes()
            .into_iter()
            .filter(|(pid, argv)| {
                let name = argv.first().map(|a| a.rsplit('/').next().unwrap_or(a));
                let shim = name.is_some_and(|n| n.starts_with("containerd-shim"))
                    && argv.iter().any(|a| a.contains(dir.as_str()));
                let vmm = vmms.contains(pid) && name == Some("twig-vmm");
                shim || vmm
            })
            .map(|(pid, argv)| format!("process {pid}: {}", argv.join(" ")))
            .collect();
        let table = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        found.extend(
            mounts_under(&table, &self.dir)
                .into_iter()
                .map(|m| format!("mount {}", m.display())),
        );
        found.extend(
            table
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|m| m.contains("/netns/cni-"))
                .map(|m| format!("network namespace {m}")),
        );
        found.extend(
            self.pinned_pod_networks()
                .into_iter()
                .map(|p| format!("pinned pod network {}", p.display())),
        );
        found
    }

    /// Stops and removes every pod through CRI (the node's containerd
    /// stops after this, with the node).
    fn remove_pods(&self) {
        let socket = self.node.socket().to_path_buf();
        // A thread with its own runtime: the node may be dropped inside a
        // test's runtime, where blocking on another one is not allowed.
        let done = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let Ok(cri) = CriClient::connect(&socket).await else {
                    return;
                };
                let cri = cri.with_timeout(TEARDOWN);
                for pod in cri.list_pod_sandboxes().await.unwrap_or_default() {
                    if let Err(e) = cri.stop_pod_sandbox(&pod.id).await {
                        eprintln!("teardown: stopping pod {}: {e}", pod.id);
                    }
                    if let Err(e) = cri.remove_pod_sandbox(&pod.id).await {
                        eprintln!("teardown: removing pod {}: {e}", pod.id);
                    }
                }
            });
        });
        // The thread's calls have deadlines; a panic in it is only logged.
        if done.join().is_err() {
            eprintln!("teardown: removing the node's pods panicked");
        }
    }
}

impl Drop for CriNode {
    fn drop(&mut self) {
        self.remove_pods();
        self.net.remove_bridge();
        // The node (a field) stops containerd, its shims and the
        // snapshotter after this.
    }
}

/// The MAC address of `ifname` inside the network namespace `netns`
/// (`aa:bb:cc:dd:ee:ff`), read on a thread that joins the namespace.
pub fn mac_in_netns(netns: &Path, ifname: &str) -> Result<String> {
    let ns = fs::File::open(netns).map_err(io(format!("opening {}", netns.display())))?;
    let what = format!("{ifname}'s MAC in {}", netns.display());
    std::thread::scope(|s| {
        s.spawn(|| -> std::io::Result<String> {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let sock = nix::sys::socket::socket(
                nix::sys::socket::AddressFamily::Inet,
                nix::sys::socket::SockType::Datagram,
                nix::sys::socket::SockFlag::SOCK_CLOEXEC,
                None,
            )?;
            // struct ifreq: the name, then a 24-byte union (here a
            // sockaddr: family, then the address bytes).
            let mut req = [0u8; libc::IFNAMSIZ + 24];
            let name = ifname.as_bytes();
            if name.len() >= libc::IFNAMSIZ {
                return Err(std::io::Error::other("interface name too long"));
            }
            req[..name.len()].copy_from_slice(name);
            // SAFETY: SIOCGIFHWADDR reads and writes a struct ifreq, which
            // `req` is large enough for.
            let rc = unsafe {
                libc::ioctl(
                    std::os::fd::AsRawFd::as_raw_fd(&sock),
                    libc::SIOCGIFHWADDR,
                    req.as_mut_ptr(),
                )
            };
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mac = &req[libc::IFNAMSIZ + 2..libc::IFNAMSIZ + 8];
            Ok(mac
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":"))
        })
        .join()
        .map_err(|_| Error::Cri(format!("reading {what}: the thread panicked")))?
        .map_err(io(format!("reading {what}")))
    })
}

/// Every process's pid and command line.
fn processes() -> Vec<(u32, Vec<String>)> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let raw = fs::read(e.path().join("cmdline")).ok()?;
            let argv = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>();
            Some((pid, argv))
        })
        .collect()
}
