//! The spec's `linux.seccomp` profile, compiled to classic BPF with
//! rust-vmm's `seccompiler` (pure Rust: no libseccomp in a static PID 1).
//!
//! A seccompiler filter has one action for the syscalls it matches and one
//! for the rest, while an OCI profile gives each rule its own action. The
//! profile becomes a stack of filters, and the kernel runs them all and
//! takes the most restrictive answer:
//!
//! - the base filter matches every rule (with its argument conditions) and
//!   answers `ALLOW` for them and the default action for the rest;
//! - one filter per other rule action matches the rules with that action
//!   and answers `ALLOW` for the rest.
//!
//! A call no rule matches gets the default action; a call a rule matches
//! gets that rule's action (if rules with different actions match the same
//! call, the most restrictive one wins). Rules whose action is the default
//! action are dropped, as runc does. A guard filter in front kills x32 ABI
//! calls (numbers with bit 30 set), which no rule can name; seccompiler's
//! architecture check kills calls of any other architecture (i386), so a
//! profile's `SCMP_ARCH_X86`/`SCMP_ARCH_X32` entries allow nothing.

use std::collections::BTreeMap;

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompFilterFlag, LinuxSeccompOperator,
    LinuxSyscall,
};
use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

use crate::syscalls::SYSCALLS;

/// A profile the agent cannot honour.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// An action seccompiler has no equivalent for.
    #[error("seccomp action {0} is not supported (no user-space notification in the guest)")]
    UnsupportedAction(String),
    /// A notification listener was asked for.
    #[error("seccomp \"listenerPath\" is not supported (no user-space notification in the guest)")]
    Listener,
    /// The profile does not cover this machine's architecture.
    #[error("the seccomp profile's architectures {0:?} do not include SCMP_ARCH_X86_64")]
    Architecture(Vec<Arch>),
    /// An argument index past the sixth.
    #[error("seccomp rule for {names:?}: argument index {index} (at most 5)")]
    ArgumentIndex {
        /// The rule's syscalls.
        names: Vec<String>,
        /// The bad index.
        index: usize,
    },
    /// seccompiler refused the filter.
    #[error("compiling the seccomp filter: {0}")]
    Compile(#[from] seccompiler::BackendError),
    /// The kernel refused the filter.
    #[error("installing the seccomp filter: {0}")]
    Install(std::io::Error),
    /// Not built for x86_64.
    #[error("seccomp profiles are supported on x86_64 guests only")]
    Platform,
}

/// A compiled profile: filters in installation order, and the flags of
/// `seccomp(SECCOMP_SET_MODE_FILTER)`.
#[derive(Debug)]
pub struct Compiled {
    /// The BPF programs, installed first to last.
    pub programs: Vec<BpfProgram>,
    /// `SECCOMP_FILTER_FLAG_*`.
    pub flags: libc::c_ulong,
    /// Syscall names the profile gives that x86_64 does not have (skipped,
    /// as runc skips names libseccomp does not know).
    pub unknown: Vec<String>,
}

fn action(a: LinuxSeccompAction, errno: Option<u32>) -> Result<SeccompAction, SeccompError> {
    let errno = errno.unwrap_or(libc::EPERM as u32);
    Ok(match a {
        LinuxSeccompAction::ScmpActAllow => SeccompAction::Allow,
        LinuxSeccompAction::ScmpActErrno => SeccompAction::Errno(errno),
        LinuxSeccompAction::ScmpActKill | LinuxSeccompAction::ScmpActKillThread => {
            SeccompAction::KillThread
        }
        LinuxSeccompAction::ScmpActKillProcess => SeccompAction::KillProcess,
        LinuxSeccompAction::ScmpActTrap => SeccompAction::Trap,
        LinuxSeccompAction::ScmpActTrace => SeccompAction::Trace(errno),
        LinuxSeccompAction::ScmpActLog => SeccompAction::Log,
        LinuxSeccompAction::ScmpActNotify => {
            return Err(SeccompError::UnsupportedAction(a.to_string()))
        }
    })
}

fn syscall_number(name: &str) -> Option<i64> {
    SYSCALLS.iter().find(|(n, _)| *n == name).map(|(_, nr)| *nr)
}

/// One rule of a syscall: its argument conditions (none: always).
fn rule(s: &LinuxSyscall) -> Result<Option<SeccompRule>, SeccompError> {
    let args = s.args().as_deref().unwrap_or_default();
    if args.is_empty() {
        return Ok(None);
    }
    let mut conditions = Vec::new();
    for a in args {
        let index = u8::try_from(a.index())
            .ok()
            .filter(|i| *i <= 5)
            .ok_or_else(|| SeccompError::ArgumentIndex {
                names: s.names().clone(),
                index: a.index(),
            })?;
        let (op, value) = match a.op() {
            LinuxSeccompOperator::ScmpCmpNe => (SeccompCmpOp::Ne, a.value()),
            LinuxSeccompOperator::ScmpCmpLt => (SeccompCmpOp::Lt, a.value()),
            LinuxSeccompOperator::ScmpCmpLe => (SeccompCmpOp::Le, a.value()),
            LinuxSeccompOperator::ScmpCmpEq => (SeccompCmpOp::Eq, a.value()),
            LinuxSeccompOperator::ScmpCmpGe => (SeccompCmpOp::Ge, a.value()),
            LinuxSeccompOperator::ScmpCmpGt => (SeccompCmpOp::Gt, a.value()),
            // libseccomp: (arg & value) == valueTwo; an absent valueTwo is
            // 0, as Go's runtime-spec omits a zero one (containerd's
            // RuntimeDefault profile allows `clone` so, without namespace
            // flags).
            LinuxSeccompOperator::ScmpCmpMaskedEq => (
                SeccompCmpOp::MaskedEq(a.value()),
                a.value_two().unwrap_or(0),
            ),
        };
        conditions.push(SeccompCondition::new(
            index,
            SeccompCmpArgLen::Qword,
            op,
            value,
        )?);
    }
    Ok(Some(SeccompRule::new(conditions)?))
}

/// Adds `s`'s rule to `rules` for each of its names (an empty chain means
/// "unconditionally", and stays so); unknown names go to `unknown`.
fn add(
    rules: &mut BTreeMap<i64, Vec<SeccompRule>>,
    s: &LinuxSyscall,
    unknown: &mut Vec<String>,
) -> Result<(), SeccompError> {
    let r = rule(s)?;
    for name in s.names() {
        let Some(nr) = syscall_number(name) else {
            if !unknown.contains(name) {
                unknown.push(name.clone());
            }
            continue;
        };
        match (rules.get_mut(&nr), &r) {
            (None, None) => {
                rules.insert(nr, Vec::new());
            }
            (None, Some(r)) => {
                rules.insert(nr, vec![r.clone()]);
            }
            (Some(chain), None) => chain.clear(),
            (Some(chain), Some(r)) if !chain.is_empty() => chain.push(r.clone()),
            (Some(_), Some(_)) => {}
        }
    }
    Ok(())
}

/// Compiles `profile` for this machine.
pub fn compile(profile: &LinuxSeccomp) -> Result<Compiled, SeccompError> {
    if !cfg!(target_arch = "x86_64") {
        return Err(SeccompError::Platform);
    }
    if profile.listener_path().is_some() {
        return Err(SeccompError::Listener);
    }
    if let Some(arches) = profile.architectures() {
        if !arches.is_empty()
            && !arches
                .iter()
                .any(|a| matches!(a, Arch::ScmpArchX86_64 | Arch::ScmpArchNative))
        {
            return Err(SeccompError::Architecture(arches.clone()));
        }
    }
    let default = action(profile.default_action(), profile.default_errno_ret())?;
    // Every rule kept (the base filter), and the rules per action other
    // than Allow, in first-seen order.
    let mut all = BTreeMap::new();
    let mut per_action: Vec<(SeccompAction, BTreeMap<i64, Vec<SeccompRule>>)> = Vec::new();
    let mut unknown = Vec::new();
    for s in profile.syscalls().iter().flatten() {
        let a = action(s.action(), s.errno_ret())?;
        if a == default {
            continue;
        }
        add(&mut all, s, &mut unknown)?;
        if a != SeccompAction::Allow {
            let idx = match per_action.iter().position(|(x, _)| *x == a) {
                Some(i) => i,
                None => {
                    per_action.push((a.clone(), BTreeMap::new()));
                    per_action.len() - 1
                }
            };
            add(&mut per_action[idx].1, s, &mut Vec::new())?;
        }
    }
    let arch = TargetArch::x86_64;
    let mut programs = vec![x32_guard()];
    if default != SeccompAction::Allow {
        programs.push(SeccompFilter::new(all, default, SeccompAction::Allow, arch)?.try_into()?);
    }
    for (a, rules) in per_action {
        programs.push(SeccompFilter::new(rules, SeccompAction::Allow, a, arch)?.try_into()?);
    }
    let mut flags = 0;
    for f in profile.flags().iter().flatten() {
        flags |= match f {
            LinuxSeccompFilterFlag::SeccompFilterFlagLog => libc::SECCOMP_FILTER_FLAG_LOG,
            LinuxSeccompFilterFlag::SeccompFilterFlagSpecAllow => {
                libc::SECCOMP_FILTER_FLAG_SPEC_ALLOW
            }
            // The helper is single-threaded; a wait-killable receive only
            // concerns notification, which is refused above.
            LinuxSeccompFilterFlag::SeccompFilterFlagTsync
            | LinuxSeccompFilterFlag::SeccompFilterFlagWaitKillableRecv => 0,
        };
    }
    Ok(Compiled {
        programs,
        flags,
        unknown,
    })
}

/// Kills calls made through the x32 ABI (syscall numbers with
/// `__X32_SYSCALL_BIT`), which seccompiler's rules never match.
fn x32_guard() -> BpfProgram {
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    let ins = |code: u16, jt: u8, jf: u8, k: u32| sock_filter { code, jt, jf, k };
    let (ld_w_abs, jge_k, ret_k) = (
        (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
        (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16,
        (libc::BPF_RET | libc::BPF_K) as u16,
    );
    vec![
        // seccomp_data.nr is at offset 0.
        ins(ld_w_abs, 0, 0, 0),
        ins(jge_k, 0, 1, X32_SYSCALL_BIT),
        ins(ret_k, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        ins(ret_k, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

/// Installs the compiled filters on the calling thread (needs
/// `no_new_privs` or CAP_SYS_ADMIN).
pub fn install(c: &Compiled) -> Result<(), SeccompError> {
    for p in &c.programs {
        let prog = libc::sock_fprog {
            len: u16::try_from(p.len()).map_err(|_| {
                SeccompError::Install(std::io::Error::from_raw_os_error(libc::E2BIG))
            })?,
            filter: p.as_ptr().cast_mut().cast(),
        };
        // SAFETY: seccomp(SECCOMP_SET_MODE_FILTER) with a sock_fprog that
        // points at `p`, which outlives the call; the kernel copies it.
        let r = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                c.flags,
                &prog as *const libc::sock_fprog,
            )
        };
        if r < 0 {
            return Err(SeccompError::Install(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(json: &str) -> LinuxSeccomp {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn masked_eq_without_value_two_compares_with_zero() {
        // containerd's RuntimeDefault profile, as Go writes it: a zero
        // valueTwo is omitted.
        let rule = |two: &str| {
            format!(
                r#"{{"defaultAction":"SCMP_ACT_ERRNO","syscalls":[{{"names":["clone"],
                   "action":"SCMP_ACT_ALLOW","args":[{{"index":0,"value":2114060288{two},
                   "op":"SCMP_CMP_MASKED_EQ"}}]}}]}}"#
            )
        };
        let without = compile(&profile(&rule(""))).unwrap();
        let zero = compile(&profile(&rule(r#","valueTwo":0"#))).unwrap();
        let other = compile(&profile(&rule(r#","valueTwo":131072"#))).unwrap();
        assert_eq!(without.programs, zero.programs);
        assert_ne!(without.programs, other.programs);
    }

    #[test]
    fn filters_per_action() {
        let c = compile(&profile(
            r#"{"defaultAction":"SCMP_ACT_ERRNO","architectures":["SCMP_ARCH_X86_64","SCMP_ARCH_X86"],
                "syscalls":[
                  {"names":["read","write","_llseek","no_such_call"],"action":"SCMP_ACT_ALLOW"},
                  {"names":["personality"],"action":"SCMP_ACT_ALLOW",
                   "args":[{"index":0,"value":8,"op":"SCMP_CMP_EQ"}]},
                  {"names":["clone"],"action":"SCMP_ACT_ALLOW",
                   "args":[{"index":0,"value":2114060288,"valueTwo":0,"op":"SCMP_CMP_MASKED_EQ"}]},
                  {"names":["clone3"],"action":"SCMP_ACT_ERRNO","errnoRet":38},
                  {"names":["ptrace"],"action":"SCMP_ACT_KILL_PROCESS"},
                  {"names":["mkdir"],"action":"SCMP_ACT_ERRNO"}
                ]}"#,
        ))
        .unwrap();
        // x32 guard, base (errno default), errno 38, kill process; the
        // rule equal to the default (mkdir: ERRNO/EPERM) is dropped.
        assert_eq!(c.programs.len(), 4);
        assert_eq!(c.unknown, vec!["_llseek", "no_such_call"]);
        assert_eq!(c.flags, 0);

        let allow_all = compile(&profile(
            r#"{"defaultAction":"SCMP_ACT_ALLOW","flags":["SECCOMP_FILTER_FLAG_LOG"],
                "syscalls":[{"names":["unshare"],"action":"SCMP_ACT_ERRNO"}]}"#,
        ))
        .unwrap();
        assert_eq!(allow_all.programs.len(), 2);
        assert_eq!(allow_all.flags, libc::SECCOMP_FILTER_FLAG_LOG);
    }

    #[test]
    fn what_cannot_be_honoured_is_refused() {
        let cases = [
            (
                r#"{"defaultAction":"SCMP_ACT_NOTIFY"}"#,
                "SCMP_ACT_NOTIFY is not supported",
            ),
            (
                r#"{"defaultAction":"SCMP_ACT_ALLOW","syscalls":[{"names":["read"],"action":"SCMP_ACT_NOTIFY"}]}"#,
                "SCMP_ACT_NOTIFY is not supported",
            ),
            (
                r#"{"defaultAction":"SCMP_ACT_ALLOW","listenerPath":"/run/x.sock"}"#,
                "listenerPath",
            ),
            (
                r#"{"defaultAction":"SCMP_ACT_ALLOW","architectures":["SCMP_ARCH_AARCH64"]}"#,
                "do not include SCMP_ARCH_X86_64",
            ),
            (
                r#"{"defaultAction":"SCMP_ACT_ALLOW","syscalls":[{"names":["read"],"action":"SCMP_ACT_ERRNO","args":[{"index":6,"value":1,"op":"SCMP_CMP_EQ"}]}]}"#,
                "argument index 6",
            ),
        ];
        for (json, want) in cases {
            let e = compile(&profile(json)).unwrap_err().to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
    }
}
