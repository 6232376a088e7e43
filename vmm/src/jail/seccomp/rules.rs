//! The rules of the seccomp filters of `twig-vmm serve`, one filter per
//! kind of thread (see `mod.rs`), and their compilation to BPF with
//! `seccompiler`. Shared by `build.rs`, which compiles them into the binary
//! (`OUT_DIR/seccomp_filters.rs`), and the tests, which check that what the
//! binary installs is what these rules compile to.
//!
//! The lists come from `strace -f` of the API tests (boot, restore,
//! snapshot, rollback, disks, vsock, net) and of the device tests, per
//! thread name; `ioctl` is restricted by request number and `socket` to
//! `AF_UNIX`.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use nr::*;

/// The filters, by the name of the thread role they confine.
pub const ROLES: [&str; 3] = ["api", "vcpu", "device"];

/// The request numbers of the KVM ioctls twig-vmm makes, as kvm-ioctls
/// defines them (its own are private).
pub mod nr {
    use kvm_bindings::{
        kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_dirty_log, kvm_fpu, kvm_irqchip, kvm_irqfd,
        kvm_lapic_state, kvm_mp_state, kvm_msr_list, kvm_msrs, kvm_pit_config, kvm_pit_state2,
        kvm_regs, kvm_sregs, kvm_userspace_memory_region, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
        KVMIO,
    };
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

    ioctl_io_nr!(KVM_GET_API_VERSION, KVMIO, 0x00);
    ioctl_io_nr!(KVM_CREATE_VM, KVMIO, 0x01);
    ioctl_iowr_nr!(KVM_GET_MSR_INDEX_LIST, KVMIO, 0x02, kvm_msr_list);
    ioctl_io_nr!(KVM_CHECK_EXTENSION, KVMIO, 0x03);
    ioctl_io_nr!(KVM_GET_VCPU_MMAP_SIZE, KVMIO, 0x04);
    ioctl_iowr_nr!(KVM_GET_SUPPORTED_CPUID, KVMIO, 0x05, kvm_cpuid2);
    ioctl_io_nr!(KVM_CREATE_VCPU, KVMIO, 0x41);
    ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
    ioctl_iow_nr!(
        KVM_SET_USER_MEMORY_REGION,
        KVMIO,
        0x46,
        kvm_userspace_memory_region
    );
    ioctl_io_nr!(KVM_SET_TSS_ADDR, KVMIO, 0x47);
    ioctl_io_nr!(KVM_CREATE_IRQCHIP, KVMIO, 0x60);
    ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
    ioctl_ior_nr!(KVM_SET_IRQCHIP, KVMIO, 0x63, kvm_irqchip);
    ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_irqfd);
    ioctl_iow_nr!(KVM_CREATE_PIT2, KVMIO, 0x77, kvm_pit_config);
    ioctl_iow_nr!(KVM_SET_CLOCK, KVMIO, 0x7b, kvm_clock_data);
    ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
    ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_pit_state2);
    ioctl_iow_nr!(KVM_SET_PIT2, KVMIO, 0xa0, kvm_pit_state2);
    ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
    ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
    ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_regs);
    ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
    ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_sregs);
    ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
    ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_msrs);
    ioctl_iow_nr!(KVM_SET_FPU, KVMIO, 0x8d, kvm_fpu);
    ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
    ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_lapic_state);
    ioctl_iow_nr!(KVM_SET_CPUID2, KVMIO, 0x90, kvm_cpuid2);
    ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
    ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
    ioctl_iow_nr!(KVM_SET_MP_STATE, KVMIO, 0x99, kvm_mp_state);
    ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
    ioctl_iow_nr!(KVM_SET_VCPU_EVENTS, KVMIO, 0xa0, kvm_vcpu_events);
    ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
    ioctl_iow_nr!(KVM_SET_DEBUGREGS, KVMIO, 0xa2, kvm_debugregs);
    ioctl_io_nr!(KVM_SET_TSC_KHZ, KVMIO, 0xa2);
    ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
    ioctl_ior_nr!(KVM_GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);
    ioctl_iow_nr!(KVM_SET_XSAVE, KVMIO, 0xa5, kvm_xsave);
    ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
    ioctl_iow_nr!(KVM_SET_XCRS, KVMIO, 0xa7, kvm_xcrs);
    // `BLKGETSIZE64` (`_IOR(0x12, 114, u64)`): a block device's size.
    ioctl_ior_nr!(BLKGETSIZE64, 0x12, 114, u64);

    // userfaultfd (linux/userfaultfd.h), for lazy restores (`uffd.rs`):
    // the structs' sizes are given as arrays of their u64 words.
    ioctl_io_nr!(USERFAULTFD_IOC_NEW, 0xAA, 0x00);
    ioctl_iowr_nr!(UFFDIO_API, 0xAA, 0x3F, [u64; 3]);
    ioctl_iowr_nr!(UFFDIO_REGISTER, 0xAA, 0x00, [u64; 4]);
    ioctl_ior_nr!(UFFDIO_UNREGISTER, 0xAA, 0x01, [u64; 2]);
    ioctl_iowr_nr!(UFFDIO_COPY, 0xAA, 0x03, [u64; 5]);
    ioctl_iowr_nr!(UFFDIO_ZEROPAGE, 0xAA, 0x04, [u64; 4]);
}

/// `FICLONE` (`_IOW(0x94, 9, int)`): reflinks of disk images.
const FICLONE: u64 = 0x4004_9409;

/// What every thread does to live and die: memory, locks, signals, time,
/// logging, and the calls of a thread's start and exit (Rust's and
/// glibc's), which a vCPU or device thread spawned by an API thread makes
/// under the API filter.
const COMMON: &[libc::c_long] = &[
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mremap,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_close,
    libc::SYS_fcntl,
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_getrandom,
];

/// Device I/O, served on vCPU threads (block, net and vsock transmit) and on
/// the device thread (net and vsock receive).
const DEVICE_IO: &[libc::c_long] = &[
    libc::SYS_readv,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_lseek,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_connect,
    libc::SYS_accept4,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    libc::SYS_poll,
    libc::SYS_ppoll,
];

/// What vCPU threads do besides device I/O: truncating the serial console
/// when it rotates (see `console.rs`; the API threads may too).
const VCPU_ONLY: &[libc::c_long] = &[libc::SYS_ftruncate];

/// What only the API threads do: files of snapshots, disks and restores;
/// VM creation (memfd, eventfds, epoll, timers, the vsock listener);
/// threads; kicking vCPUs.
const API_ONLY: &[libc::c_long] = &[
    libc::SYS_openat,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rename,
    libc::SYS_renameat2,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rmdir,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_getdents64,
    libc::SYS_getcwd,
    libc::SYS_readlink,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_copy_file_range,
    libc::SYS_sync_file_range,
    libc::SYS_memfd_create,
    libc::SYS_eventfd2,
    libc::SYS_epoll_create1,
    libc::SYS_timerfd_create,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_getsockname,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_tgkill,
    libc::SYS_rt_sigaction,
    libc::SYS_prlimit64,
];

fn kvm_system_ioctls() -> Vec<u64> {
    [
        KVM_GET_API_VERSION(),
        KVM_CREATE_VM(),
        KVM_GET_MSR_INDEX_LIST(),
        KVM_CHECK_EXTENSION(),
        KVM_GET_VCPU_MMAP_SIZE(),
        KVM_GET_SUPPORTED_CPUID(),
        KVM_CREATE_VCPU(),
        KVM_GET_DIRTY_LOG(),
        KVM_SET_USER_MEMORY_REGION(),
        KVM_SET_TSS_ADDR(),
        KVM_CREATE_IRQCHIP(),
        KVM_GET_IRQCHIP(),
        KVM_SET_IRQCHIP(),
        KVM_IRQFD(),
        KVM_CREATE_PIT2(),
        KVM_SET_CLOCK(),
        KVM_GET_CLOCK(),
        KVM_GET_PIT2(),
        KVM_SET_PIT2(),
        libc::TUNSETIFF,
        libc::TUNGETIFF,
        libc::TUNSETVNETHDRSZ,
        libc::FIONBIO,
        FICLONE,
        BLKGETSIZE64(),
        // A lazy restore makes its userfaultfd from the /dev/userfaultfd
        // descriptor it is sent and registers guest RAM; its watcher
        // unregisters RAM once the page server is done (`uffd.rs`).
        USERFAULTFD_IOC_NEW(),
        UFFDIO_API(),
        UFFDIO_REGISTER(),
        UFFDIO_UNREGISTER(),
    ]
    .to_vec()
}

fn kvm_vcpu_ioctls() -> Vec<u64> {
    [
        KVM_RUN(),
        KVM_GET_REGS(),
        KVM_SET_REGS(),
        KVM_GET_SREGS(),
        KVM_SET_SREGS(),
        KVM_GET_MSRS(),
        KVM_SET_MSRS(),
        KVM_SET_FPU(),
        KVM_GET_LAPIC(),
        KVM_SET_LAPIC(),
        KVM_SET_CPUID2(),
        KVM_GET_CPUID2(),
        KVM_GET_MP_STATE(),
        KVM_SET_MP_STATE(),
        KVM_GET_VCPU_EVENTS(),
        KVM_SET_VCPU_EVENTS(),
        KVM_GET_DEBUGREGS(),
        KVM_SET_DEBUGREGS(),
        KVM_SET_TSC_KHZ(),
        KVM_GET_TSC_KHZ(),
        KVM_GET_XSAVE2(),
        KVM_SET_XSAVE(),
        KVM_GET_XCRS(),
        KVM_SET_XCRS(),
        KVM_CHECK_EXTENSION(),
        libc::FIONBIO,
    ]
    .to_vec()
}

/// One rule per allowed value of argument `arg`.
fn arg_in(arg: u8, values: &[u64]) -> Result<Vec<SeccompRule>, String> {
    values
        .iter()
        .map(|&v| {
            let cond = SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, v)
                .map_err(|e| e.to_string())?;
            SeccompRule::new(vec![cond]).map_err(|e| e.to_string())
        })
        .collect()
}

fn rules(role: &str) -> Result<BTreeMap<i64, Vec<SeccompRule>>, String> {
    let (calls, ioctls, prctl): (Vec<libc::c_long>, Vec<u64>, bool) = match role {
        "api" => {
            let mut ioctls = kvm_system_ioctls();
            ioctls.extend(kvm_vcpu_ioctls());
            ioctls.sort_unstable();
            ioctls.dedup();
            ([COMMON, DEVICE_IO, API_ONLY].concat(), ioctls, true)
        }
        "vcpu" => (
            [COMMON, DEVICE_IO, VCPU_ONLY].concat(),
            kvm_vcpu_ioctls(),
            false,
        ),
        // The device thread accepts the host's vsock connections and makes
        // them non-blocking (std does that with FIONBIO).
        "device" => ([COMMON, DEVICE_IO].concat(), vec![libc::FIONBIO], false),
        _ => return Err(format!("no seccomp filter for {role:?}")),
    };
    let mut map: BTreeMap<i64, Vec<SeccompRule>> =
        calls.into_iter().map(|c| (c, Vec::new())).collect();
    if !ioctls.is_empty() {
        map.insert(libc::SYS_ioctl, arg_in(1, &ioctls)?);
    }
    if prctl {
        // Threads it spawns name themselves and then install their own
        // (narrower) filter.
        map.insert(
            libc::SYS_prctl,
            arg_in(
                0,
                &[libc::PR_SET_NAME as u64, libc::PR_SET_NO_NEW_PRIVS as u64],
            )?,
        );
        map.insert(
            libc::SYS_seccomp,
            arg_in(0, &[u64::from(libc::SECCOMP_SET_MODE_FILTER)])?,
        );
    }
    // Vsock connections to the host side are Unix sockets.
    map.insert(libc::SYS_socket, arg_in(0, &[libc::AF_UNIX as u64])?);
    Ok(map)
}

/// The filter of `role` (one of [`ROLES`]) for `arch` (Rust's name of the
/// target architecture), as BPF: a system call outside it kills the
/// process.
pub fn compile(role: &str, arch: &str) -> Result<BpfProgram, String> {
    let arch: TargetArch = arch
        .try_into()
        .map_err(|e| format!("architecture {arch}: {e:?}"))?;
    let filter = SeccompFilter::new(
        rules(role)?,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        arch,
    )
    .map_err(|e| format!("{role}: {e}"))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| format!("{role}: {e}"))
}
