//! `linux.sysctl`: only sysctls that belong to a namespace the container
//! lives in (runc's list: IPC and POSIX message queue sysctls, `net.*`,
//! `kernel.domainname`) are accepted; any other would change the whole
//! VM's kernel and is refused. They are written under `/proc/sys` by the
//! helper once it is in the container's namespaces, before the rootfs is
//! entered (the container's own `/proc/sys` is usually read-only).
//!
//! Without its own ipc or network namespace a container shares the VM's,
//! which in Twig is the pod's: the sysctl then applies pod-wide, like a
//! Kubernetes pod-level sysctl.

use std::collections::HashMap;
use std::path::PathBuf;

/// The IPC sysctls of `kernel.*`.
const IPC_SYSCTLS: &[&str] = &[
    "kernel.msgmax",
    "kernel.msgmnb",
    "kernel.msgmni",
    "kernel.sem",
    "kernel.shmall",
    "kernel.shmmax",
    "kernel.shmmni",
    "kernel.shm_rmid_forced",
];

/// Why a sysctl is refused.
#[derive(Debug, thiserror::Error)]
pub enum SysctlError {
    /// Not a namespaced sysctl.
    #[error("sysctl {0:?} is not namespaced (it would change the whole VM's kernel)")]
    NotNamespaced(String),
    /// `kernel.hostname`: the spec's `hostname` does that.
    #[error("sysctl \"kernel.hostname\" is not allowed: use the spec's \"hostname\"")]
    Hostname,
    /// A name that would leave `/proc/sys`.
    #[error("sysctl name {0:?} is malformed")]
    Malformed(String),
    /// A value with a NUL byte.
    #[error("sysctl {0:?}: the value contains a NUL byte")]
    Value(String),
}

/// The `/proc/sys` path of a sysctl written with dots or slashes.
fn path(name: &str) -> Result<PathBuf, SysctlError> {
    let rel = name.replace('.', "/");
    if rel.is_empty() || rel.split('/').any(|part| part.is_empty() || part == "..") {
        return Err(SysctlError::Malformed(name.to_string()));
    }
    Ok(PathBuf::from("/proc/sys").join(rel))
}

/// Checks that every sysctl is namespaced and well-formed.
pub fn validate(sysctls: &HashMap<String, String>) -> Result<(), SysctlError> {
    for (name, value) in sysctls {
        path(name)?;
        if value.contains('\0') {
            return Err(SysctlError::Value(name.clone()));
        }
        let dotted = name.replace('/', ".");
        if dotted == "kernel.hostname" {
            return Err(SysctlError::Hostname);
        }
        let ok = IPC_SYSCTLS.contains(&dotted.as_str())
            || dotted.starts_with("fs.mqueue.")
            || dotted.starts_with("net.")
            || dotted == "kernel.domainname";
        if !ok {
            return Err(SysctlError::NotNamespaced(name.clone()));
        }
    }
    Ok(())
}

/// Writes every sysctl (already validated) in the caller's namespaces.
pub fn apply(sysctls: &HashMap<String, String>) -> Result<(), String> {
    for (name, value) in sysctls {
        let p = path(name).map_err(|e| e.to_string())?;
        std::fs::write(&p, value.as_bytes())
            .map_err(|e| format!("setting sysctl {name} = {value:?}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(name: &str) -> Result<(), SysctlError> {
        validate(&HashMap::from([(name.to_string(), "1".to_string())]))
    }

    #[test]
    fn namespaced_only() {
        for ok in [
            "kernel.shm_rmid_forced",
            "kernel/sem",
            "fs.mqueue.msg_max",
            "net.ipv4.ip_unprivileged_port_start",
            "net/core/somaxconn",
        ] {
            one(ok).unwrap();
        }
        let e = one("kernel.panic").unwrap_err().to_string();
        assert!(e.contains("\"kernel.panic\" is not namespaced"), "{e}");
        assert!(one("vm.overcommit_memory").is_err());
        assert!(one("kernel.hostname")
            .unwrap_err()
            .to_string()
            .contains("hostname"));
        assert!(matches!(one("net..x"), Err(SysctlError::Malformed(_))));
        assert!(matches!(
            one("net/../kernel/x"),
            Err(SysctlError::Malformed(_))
        ));
        assert_eq!(
            path("net.ipv4.ip_forward").unwrap(),
            PathBuf::from("/proc/sys/net/ipv4/ip_forward")
        );
    }
}
