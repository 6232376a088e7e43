//! The pod network of one harness: a CNI bridge with its own /24 and its
//! own host-local IPAM store, reserved with a lock file so that harnesses
//! running at the same time (tests in parallel, a benchmark) never share a
//! bridge or a subnet.

use super::{run, HarnessError};
use serde_json::json;
use std::fs::{self, File};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Where the slot lock files live.
const LOCK_DIR: &str = "/run/twig-cri";
/// How many harnesses may run at once on one machine.
const SLOTS: u8 = 64;
/// The second octet of every harness subnet: `10.213.<slot>.0/24`.
const SUBNET_OCTET: u8 = 213;

/// A reserved bridge name and subnet; released when dropped.
pub struct NetSlot {
    index: u8,
    _lock: File,
}

impl NetSlot {
    /// Reserves the first free slot.
    pub fn acquire() -> Result<NetSlot, HarnessError> {
        fs::create_dir_all(LOCK_DIR)
            .map_err(|e| HarnessError::io(format!("creating {LOCK_DIR}"), e))?;
        for index in 0..SLOTS {
            let path = Path::new(LOCK_DIR).join(format!("net-{index}.lock"));
            let file = File::create(&path)
                .map_err(|e| HarnessError::io(format!("creating {}", path.display()), e))?;
            // SAFETY: flock(2) on a descriptor `file` owns and keeps open;
            // the lock lives as long as the file.
            let locked =
                unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
            if locked {
                let slot = NetSlot { index, _lock: file };
                // A bridge left by a harness that died holding this slot.
                slot.remove_bridge();
                return Ok(slot);
            }
        }
        Err(HarnessError::NoNetSlot(SLOTS))
    }

    /// The bridge's interface name, `twigcri<slot>`.
    pub fn bridge(&self) -> String {
        format!("twigcri{}", self.index)
    }

    /// The pods' subnet, `10.213.<slot>.0/24`.
    pub fn subnet(&self) -> String {
        format!("10.{SUBNET_OCTET}.{}.0/24", self.index)
    }

    /// The bridge's own address: the host end of the pod network.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, SUBNET_OCTET, self.index, 1)
    }

    /// The CNI network's name.
    pub fn network_name(&self) -> String {
        format!("twig-cri-{}", self.index)
    }

    /// Writes the bridge + host-local conflist into `conf_dir`, with the
    /// IPAM's allocations kept in `ipam_dir`.
    pub fn write_cni_config(&self, conf_dir: &Path, ipam_dir: &Path) -> Result<(), HarnessError> {
        let conf = json!({
            "cniVersion": "0.4.0",
            "name": self.network_name(),
            "plugins": [{
                "type": "bridge",
                "bridge": self.bridge(),
                "isGateway": true,
                // A default route via the bridge in every pod, as a
                // cluster's pod network gives: egress beyond the subnet is
                // routed (and so filtered, not unreachable).
                "isDefaultGateway": true,
                "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": self.subnet(), "gateway": self.gateway().to_string() }]],
                    "dataDir": ipam_dir.to_string_lossy(),
                },
            }],
        });
        fs::create_dir_all(conf_dir)
            .map_err(|e| HarnessError::io(format!("creating {}", conf_dir.display()), e))?;
        let path = conf_dir.join("10-twig-cri.conflist");
        fs::write(&path, conf.to_string())
            .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))
    }

    /// Deletes the bridge if it exists (CNI creates it, nothing removes it).
    pub fn remove_bridge(&self) {
        let bridge = self.bridge();
        if Path::new("/sys/class/net").join(&bridge).exists() {
            if let Err(e) = run(
                Command::new("ip").args(["link", "del", &bridge]),
                Duration::from_secs(10),
            ) {
                tracing::warn!(%e, "removing the CNI bridge");
            }
        }
    }
}
