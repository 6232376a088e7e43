//! Seccomp filters for the `twig-vmm serve` process, one per kind of thread.
//! A syscall outside a thread's filter kills the whole process
//! (`SECCOMP_RET_KILL_PROCESS`): the shim sees the VMM exit with `SIGSYS`,
//! never a half-alive process.
//!
//! Filters are per thread and stack: a thread inherits its creator's filter
//! and adds its own. The API filter (the main thread and every API
//! connection thread) therefore allows everything the vCPU and device
//! threads need as well, because a VM created by an API request spawns its
//! vCPU and device threads from an API thread; those threads then narrow
//! themselves to their own filter (the kernel runs every stacked filter
//! and the strictest answer wins).
//!
//! The rules are in `rules.rs`; `build.rs` compiles them to BPF with
//! `seccompiler` when twig-vmm is built, so a VMM process only hands the
//! kernel a static program (building the three filters at start took
//! about 0.45 ms of every spawn, under strace).

#[cfg(test)]
pub(crate) mod rules;

use std::sync::atomic::{AtomicBool, Ordering};

use super::JailError;

/// The BPF programs `build.rs` compiled from `rules.rs`: `API`, `VCPU`,
/// `DEVICE`.
mod compiled {
    include!(concat!(env!("OUT_DIR"), "/seccomp_filters.rs"));
}

/// The kinds of thread in a `twig-vmm serve` process, each with its filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The main thread and the API connection threads: VM creation,
    /// snapshots, restore and rollback files, and (inherited by the threads
    /// they spawn) everything the other roles need.
    Api,
    /// A vCPU thread: `KVM_RUN`, vCPU state, and the devices served on it
    /// (net and vsock transmit).
    Vcpu,
    /// The device thread (epoll over the tap, the vsock sockets and
    /// timers) and the disks' I/O threads (block I/O).
    Device,
}

impl Role {
    /// The role's filter.
    fn program(self) -> &'static [libc::sock_filter] {
        match self {
            Role::Api => compiled::API,
            Role::Vcpu => compiled::VCPU,
            Role::Device => compiled::DEVICE,
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns the filters on for this process: from now on, every vCPU and
/// device thread installs its filter when it starts, and [`confine`]
/// installs one on the calling thread. Idempotent.
pub fn enable() {
    ENABLED.store(true, Ordering::SeqCst);
}

/// Whether [`enable`] was called in this process.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::SeqCst)
}

/// Installs `role`'s filter on the calling thread (and so on the threads it
/// spawns later); nothing if the filters are not enabled. Also sets
/// `PR_SET_NO_NEW_PRIVS` on the thread.
pub fn confine(role: Role) -> Result<(), JailError> {
    if enabled() {
        install(role)
    } else {
        Ok(())
    }
}

/// Installs `role`'s filter on the calling thread whether or not the
/// filters are enabled, after setting `PR_SET_NO_NEW_PRIVS` on it.
pub fn install(role: Role) -> Result<(), JailError> {
    let prog = role.program();
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integers only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(JailError::Seccomp(format!(
            "{role:?}: PR_SET_NO_NEW_PRIVS: {e}"
        )));
    }
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr().cast_mut(),
    };
    // SAFETY: `fprog` points to a whole program that lives for the whole
    // process; the kernel copies it and writes nothing through the pointer.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            &fprog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(JailError::Seccomp(format!("{role:?}: {e}")));
    }
    Ok(())
}

/// Called first thing by a vCPU or device thread. A thread that cannot be
/// confined must not run guest-facing code: the process is aborted.
pub(crate) fn thread_start(role: Role) {
    if let Err(e) = confine(role) {
        tracing::error!("cannot install the seccomp filter of a {role:?} thread: {e}");
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instructions(p: &[libc::sock_filter]) -> Vec<(u16, u8, u8, u32)> {
        p.iter().map(|i| (i.code, i.jt, i.jf, i.k)).collect()
    }

    #[test]
    fn the_built_in_filters_are_what_the_rules_compile_to() {
        for (role, name) in [Role::Api, Role::Vcpu, Role::Device]
            .into_iter()
            .zip(rules::ROLES)
        {
            let want: Vec<_> = rules::compile(name, std::env::consts::ARCH)
                .expect("the rules compile")
                .iter()
                .map(|i| (i.code, i.jt, i.jf, i.k))
                .collect();
            assert_eq!(instructions(role.program()), want, "{role:?}");
        }
        assert!(rules::compile("other", std::env::consts::ARCH).is_err());
    }

    #[test]
    fn the_rules_name_the_ioctls_twig_vmm_makes() {
        assert_eq!(
            rules::nr::BLKGETSIZE64(),
            crate::virtio::blk::BLKGETSIZE64()
        );
    }

    /// Runs `f` on a new thread that installed `role`'s filter, in a child
    /// process (a forbidden call kills the whole process); returns how the
    /// child ended.
    fn in_confined_child(role: Role, f: fn()) -> std::process::ExitStatus {
        use std::os::unix::process::ExitStatusExt;
        // SAFETY: the child only spawns a thread, runs `f` there and exits;
        // the test harness's other threads are not touched in it.
        match unsafe { libc::fork() } {
            0 => {
                let code = std::thread::spawn(move || {
                    install(role).expect("installing the filter");
                    f();
                })
                .join()
                .map_or(2, |()| 0);
                // SAFETY: ends the child without running the parent's
                // exit handlers.
                unsafe { libc::_exit(code) }
            }
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            pid => {
                let mut status = 0;
                // SAFETY: waits for the child just forked.
                let r = unsafe { libc::waitpid(pid, &mut status, 0) };
                assert_eq!(r, pid, "waitpid");
                std::process::ExitStatus::from_raw(status)
            }
        }
    }

    #[test]
    fn a_call_outside_a_filter_kills_the_process() {
        use std::os::unix::process::ExitStatusExt;
        fn personality() {
            // SAFETY: personality(0xffffffff) only reads the persona.
            unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffff_u64) };
        }
        fn getpid() {
            // SAFETY: getpid has no arguments.
            unsafe { libc::getpid() };
        }
        fn inet_socket() {
            // SAFETY: a socket(2) call with integer arguments.
            unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        }
        fn open_file() {
            let _ = std::fs::File::open("/proc/self/status");
        }
        for role in [Role::Api, Role::Vcpu, Role::Device] {
            let s = in_confined_child(role, personality);
            assert_eq!(s.signal(), Some(libc::SIGSYS), "{role:?} personality: {s}");
            let s = in_confined_child(role, inet_socket);
            assert_eq!(s.signal(), Some(libc::SIGSYS), "{role:?} AF_INET: {s}");
            let s = in_confined_child(role, getpid);
            assert_eq!(s.code(), Some(0), "{role:?} getpid: {s}");
        }
        let s = in_confined_child(Role::Api, open_file);
        assert_eq!(s.code(), Some(0), "api open: {s}");
        for role in [Role::Vcpu, Role::Device] {
            let s = in_confined_child(role, open_file);
            assert_eq!(s.signal(), Some(libc::SIGSYS), "{role:?} open: {s}");
        }
    }
}
