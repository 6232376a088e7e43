//! Validation of ids and OCI specs, and the plan derived from a spec: which
//! namespaces to create and which to join.

use std::path::{Component, Path, PathBuf};

use nix::sched::CloneFlags;
use oci_spec::runtime::{LinuxNamespaceType, Process, Spec};

use crate::error::{AgentError, Result};

/// Checks that a container or exec id is a safe file name: 1–128 of
/// `[A-Za-z0-9_.-]`, starting with a letter or digit.
pub fn validate_id(kind: &str, id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(AgentError::InvalidArgument(format!(
            "invalid {kind} id {id:?}: use 1-128 characters of [A-Za-z0-9_.-], starting with a letter or digit"
        )))
    }
}

fn invalid(msg: String) -> AgentError {
    AgentError::InvalidArgument(format!("invalid OCI spec: {msg}"))
}

/// Parses and validates an OCI runtime spec (config.json).
pub fn parse_spec(json: &[u8]) -> Result<Spec> {
    if json.is_empty() {
        return Err(invalid("empty".to_string()));
    }
    let spec: Spec = serde_json::from_slice(json).map_err(|e| invalid(e.to_string()))?;
    let process = spec
        .process()
        .as_ref()
        .ok_or_else(|| invalid("no \"process\"".to_string()))?;
    validate_process(process).map_err(|e| invalid(e.to_string()))?;
    if spec.hooks().is_some() {
        return Err(invalid("\"hooks\" are not supported".to_string()));
    }
    for m in spec.mounts().iter().flatten() {
        if !m.destination().is_absolute() {
            return Err(invalid(format!(
                "mount destination {:?} is not absolute",
                m.destination()
            )));
        }
    }
    let plan = NamespacePlan::from_spec(&spec)?;
    if spec.hostname().as_deref().is_some_and(|h| !h.is_empty()) && !plan.new_uts {
        return Err(invalid(
            "\"hostname\" needs a new uts namespace (the VM's hostname belongs to Reidentify)"
                .to_string(),
        ));
    }
    if let Some(linux) = spec.linux() {
        if linux.uid_mappings().as_ref().is_some_and(|m| !m.is_empty())
            || linux.gid_mappings().as_ref().is_some_and(|m| !m.is_empty())
        {
            return Err(invalid("uid/gid mappings are not supported".to_string()));
        }
        for p in linux
            .masked_paths()
            .iter()
            .chain(linux.readonly_paths())
            .flatten()
        {
            if !Path::new(p).is_absolute() {
                return Err(invalid(format!(
                    "masked or read-only path {p:?} is not absolute"
                )));
            }
        }
        if let Some(profile) = linux.seccomp() {
            let compiled = crate::seccomp::compile(profile)
                .map_err(|e| invalid(format!("linux.seccomp: {e}")))?;
            if !compiled.unknown.is_empty() {
                tracing::debug!(names = ?compiled.unknown, "seccomp: syscalls x86_64 does not have are skipped");
            }
        }
        if let Some(sysctls) = linux.sysctl() {
            crate::sysctl::validate(sysctls).map_err(|e| invalid(format!("linux.sysctl: {e}")))?;
        }
        for d in linux.devices().iter().flatten() {
            if !d.path().is_absolute() {
                return Err(invalid(format!(
                    "device path {:?} is not absolute",
                    d.path()
                )));
            }
        }
    }
    Ok(spec)
}

/// Parses and validates an OCI `process` object (ExecProcess).
pub fn parse_process(json: &[u8]) -> Result<Process> {
    let err = |m: String| AgentError::InvalidArgument(format!("invalid OCI process: {m}"));
    if json.is_empty() {
        return Err(err("empty".to_string()));
    }
    let process: Process = serde_json::from_slice(json).map_err(|e| err(e.to_string()))?;
    validate_process(&process).map_err(|e| err(e.to_string()))?;
    Ok(process)
}

fn validate_process(p: &Process) -> Result<()> {
    let args = p.args().as_deref().unwrap_or_default();
    if args.is_empty() || args[0].is_empty() {
        return Err(AgentError::InvalidArgument(
            "\"args\" is missing or empty".to_string(),
        ));
    }
    if args.iter().any(|a| a.contains('\0')) {
        return Err(AgentError::InvalidArgument(
            "an argument contains a NUL byte".to_string(),
        ));
    }
    if p.env()
        .iter()
        .flatten()
        .any(|e| e.contains('\0') || !e.contains('='))
    {
        return Err(AgentError::InvalidArgument(
            "an \"env\" entry is not NAME=value".to_string(),
        ));
    }
    if !p.cwd().is_absolute() {
        return Err(AgentError::InvalidArgument(format!(
            "\"cwd\" {:?} is not absolute",
            p.cwd()
        )));
    }
    Ok(())
}

/// What a container's init needs in namespaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespacePlan {
    /// Namespaces to create (clone flags); always includes a mount namespace.
    pub clone_flags: CloneFlags,
    /// Existing namespaces to join (except pid), by path.
    pub join: Vec<(LinuxNamespaceType, PathBuf)>,
    /// An existing pid namespace to join.
    pub join_pid: Option<PathBuf>,
    /// A new network namespace is created (its `lo` is brought up).
    pub new_net: bool,
    /// A new uts namespace is created.
    pub new_uts: bool,
}

impl NamespacePlan {
    /// Derives the plan from `spec.linux.namespaces`.
    pub fn from_spec(spec: &Spec) -> Result<NamespacePlan> {
        let mut plan = NamespacePlan {
            clone_flags: CloneFlags::CLONE_NEWNS,
            join: Vec::new(),
            join_pid: None,
            new_net: false,
            new_uts: false,
        };
        let namespaces = spec
            .linux()
            .as_ref()
            .and_then(|l| l.namespaces().clone())
            .unwrap_or_default();
        for ns in namespaces {
            let Some(flag) = ns_flag(ns.typ()) else {
                return Err(invalid(format!(
                    "{} namespaces are not supported",
                    ns.typ()
                )));
            };
            match ns.path() {
                None => {
                    plan.clone_flags |= flag;
                    plan.new_net |= flag == CloneFlags::CLONE_NEWNET;
                    plan.new_uts |= flag == CloneFlags::CLONE_NEWUTS;
                }
                Some(path) if !path.is_absolute() => {
                    return Err(invalid(format!(
                        "{} namespace path {path:?} is not absolute",
                        ns.typ()
                    )))
                }
                Some(_) if flag == CloneFlags::CLONE_NEWNS => {
                    return Err(invalid(
                        "joining an existing mount namespace is not supported".to_string(),
                    ))
                }
                Some(path) if flag == CloneFlags::CLONE_NEWPID => {
                    plan.join_pid = Some(path.clone())
                }
                Some(path) => plan.join.push((ns.typ(), path.clone())),
            }
        }
        Ok(plan)
    }
}

/// Joins `path` (absolute, inside the container) onto `root` without
/// letting `..` or symlinks escape `root`: symlinks are resolved as if
/// `root` were `/`. Components that do not exist yet are appended as they
/// are.
pub fn secure_join(root: &Path, path: &Path) -> std::io::Result<PathBuf> {
    let mut resolved = PathBuf::new();
    let mut pending: Vec<std::ffi::OsString> = path
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect();
    let mut links = 0;
    while let Some(part) = pending.pop() {
        if part == ".." {
            resolved.pop();
            continue;
        }
        let candidate = root.join(&resolved).join(&part);
        match std::fs::symlink_metadata(&candidate) {
            Ok(meta) if meta.file_type().is_symlink() => {
                links += 1;
                if links > 40 {
                    return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
                }
                let target = std::fs::read_link(&candidate)?;
                if target.is_absolute() {
                    resolved = PathBuf::new();
                }
                for c in target.components().rev() {
                    match c {
                        Component::Normal(n) => pending.push(n.to_os_string()),
                        Component::ParentDir => pending.push("..".into()),
                        _ => {}
                    }
                }
            }
            _ => resolved.push(&part),
        }
    }
    Ok(root.join(resolved))
}

/// The clone/setns flag of a namespace type Twig supports.
pub fn ns_flag(typ: LinuxNamespaceType) -> Option<CloneFlags> {
    Some(match typ {
        LinuxNamespaceType::Mount => CloneFlags::CLONE_NEWNS,
        LinuxNamespaceType::Uts => CloneFlags::CLONE_NEWUTS,
        LinuxNamespaceType::Ipc => CloneFlags::CLONE_NEWIPC,
        LinuxNamespaceType::Pid => CloneFlags::CLONE_NEWPID,
        LinuxNamespaceType::Network => CloneFlags::CLONE_NEWNET,
        LinuxNamespaceType::Cgroup => CloneFlags::CLONE_NEWCGROUP,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_json(extra: &str) -> String {
        format!(
            r#"{{"ociVersion":"1.0.2","process":{{"args":["echo","hi"],"cwd":"/","user":{{"uid":0,"gid":0}}}},
               "root":{{"path":"rootfs"}}{extra}}}"#
        )
    }

    #[test]
    fn ids() {
        validate_id("container", "pod-1_a.b").unwrap();
        for bad in ["", "../x", ".hidden", "a/b", "a b", &"x".repeat(129)] {
            assert!(validate_id("container", bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn good_spec_parses() {
        let s = parse_spec(spec_json("").as_bytes()).unwrap();
        assert_eq!(
            s.process().as_ref().unwrap().args().as_ref().unwrap()[0],
            "echo"
        );
    }

    #[test]
    fn bad_specs_are_rejected_with_the_reason() {
        let cases = [
            ("{not json", "invalid OCI spec"),
            (r#"{"ociVersion":"1.0.2"}"#, "no \"process\""),
            (
                r#"{"ociVersion":"1.0.2","process":{"args":[],"cwd":"/","user":{"uid":0,"gid":0}}}"#,
                "\"args\" is missing or empty",
            ),
            (
                r#"{"ociVersion":"1.0.2","process":{"args":["x"],"cwd":"rel","user":{"uid":0,"gid":0}}}"#,
                "not absolute",
            ),
        ];
        for (json, want) in cases {
            let e = parse_spec(json.as_bytes()).unwrap_err().to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
        let e = parse_spec(spec_json(r#","hostname":"x""#).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains("uts namespace"), "{e}");
        let e = parse_spec(spec_json(r#","linux":{"namespaces":[{"type":"user"}]}"#).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains("user namespaces are not supported"), "{e}");
        let e = parse_spec(spec_json(r#","hooks":{}"#).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains("hooks"), "{e}");
    }

    #[test]
    fn namespace_plan() {
        let s = parse_spec(
            spec_json(
                r#","hostname":"h","linux":{"namespaces":[{"type":"pid"},{"type":"uts"},{"type":"network","path":"/run/netns/x"},{"type":"mount"}]}"#,
            )
            .as_bytes(),
        )
        .unwrap();
        let plan = NamespacePlan::from_spec(&s).unwrap();
        assert_eq!(
            plan.clone_flags,
            CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWUTS
        );
        assert_eq!(plan.join.len(), 1);
        assert!(!plan.new_net);
        assert!(plan.new_uts);
    }

    #[test]
    fn secure_join_stays_inside() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("real")).unwrap();
        std::os::unix::fs::symlink("/real", root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../etc", root.join("up")).unwrap();
        assert_eq!(
            secure_join(root, Path::new("/abs/x")).unwrap(),
            root.join("real/x")
        );
        assert_eq!(
            secure_join(root, Path::new("/up/passwd")).unwrap(),
            root.join("etc/passwd")
        );
        assert_eq!(
            secure_join(root, Path::new("/../../a")).unwrap(),
            root.join("a")
        );
    }
}
