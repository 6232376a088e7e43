//! Capabilities of a container process, applied as runc applies them: the
//! bounding set is dropped while still root, the permitted set survives the
//! uid change through `PR_SET_KEEPCAPS`, then `capset` sets effective,
//! permitted and inheritable and the ambient set is rebuilt.
//!
//! A process without `capabilities` gets empty sets (runc's rule), so a
//! root process without them is root without privileges.

use oci_spec::runtime::{Capabilities, Capability, Process};

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit sets in two 32-bit halves.
const CAP_VERSION_3: u32 = 0x2008_0522;

/// The five capability sets of a process, as bit masks by capability number.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CapSets {
    /// What the process (and its children) can ever gain.
    pub bounding: u64,
    /// What the kernel checks.
    pub effective: u64,
    /// What the process may make effective.
    pub permitted: u64,
    /// What survives execve into programs with inheritable file caps.
    pub inheritable: u64,
    /// What survives execve of ordinary programs, also as non-root.
    pub ambient: u64,
}

/// The kernel's number of a capability.
pub fn number(c: Capability) -> u8 {
    use Capability::*;
    match c {
        Chown => 0,
        DacOverride => 1,
        DacReadSearch => 2,
        Fowner => 3,
        Fsetid => 4,
        Kill => 5,
        Setgid => 6,
        Setuid => 7,
        Setpcap => 8,
        LinuxImmutable => 9,
        NetBindService => 10,
        NetBroadcast => 11,
        NetAdmin => 12,
        NetRaw => 13,
        IpcLock => 14,
        IpcOwner => 15,
        SysModule => 16,
        SysRawio => 17,
        SysChroot => 18,
        SysPtrace => 19,
        SysPacct => 20,
        SysAdmin => 21,
        SysBoot => 22,
        SysNice => 23,
        SysResource => 24,
        SysTime => 25,
        SysTtyConfig => 26,
        Mknod => 27,
        Lease => 28,
        AuditWrite => 29,
        AuditControl => 30,
        Setfcap => 31,
        MacOverride => 32,
        MacAdmin => 33,
        Syslog => 34,
        WakeAlarm => 35,
        BlockSuspend => 36,
        AuditRead => 37,
        Perfmon => 38,
        Bpf => 39,
        CheckpointRestore => 40,
    }
}

fn mask(set: &Option<Capabilities>) -> u64 {
    set.iter()
        .flatten()
        .fold(0, |m, c| m | (1u64 << number(*c)))
}

impl CapSets {
    /// The sets a process asks for (all empty without `capabilities`).
    pub fn of(p: &Process) -> CapSets {
        let Some(c) = p.capabilities() else {
            return CapSets::default();
        };
        CapSets {
            bounding: mask(c.bounding()),
            effective: mask(c.effective()),
            permitted: mask(c.permitted()),
            inheritable: mask(c.inheritable()),
            ambient: mask(c.ambient()),
        }
    }
}

fn prctl(what: &str, op: libc::c_int, arg: libc::c_ulong) -> Result<libc::c_int, String> {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(op, arg, 0 as libc::c_ulong, 0 as libc::c_ulong, 0) };
    if r < 0 {
        return Err(format!("{what}: {}", std::io::Error::last_os_error()));
    }
    Ok(r)
}

/// Drops every capability outside `sets.bounding` from the bounding set
/// (needs CAP_SETPCAP: call while still root) and sets `PR_SET_KEEPCAPS`
/// so the permitted set survives the coming uid change.
pub fn before_setuid(sets: &CapSets) -> Result<(), String> {
    for cap in 0..64u8 {
        // SAFETY: prctl with integer arguments only.
        let present = unsafe { libc::prctl(libc::PR_CAPBSET_READ, libc::c_ulong::from(cap)) };
        if present < 0 {
            // EINVAL: past the kernel's last capability.
            break;
        }
        if present == 1 && sets.bounding & (1 << cap) == 0 {
            prctl(
                &format!("dropping capability {cap} from the bounding set"),
                libc::PR_CAPBSET_DROP,
                libc::c_ulong::from(cap),
            )?;
        }
    }
    prctl("PR_SET_KEEPCAPS", libc::PR_SET_KEEPCAPS, 1)?;
    Ok(())
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// After the uid change: clears `PR_SET_KEEPCAPS`, sets effective,
/// permitted and inheritable with `capset`, and replaces the ambient set.
pub fn after_setuid(sets: &CapSets) -> Result<(), String> {
    prctl("clearing PR_SET_KEEPCAPS", libc::PR_SET_KEEPCAPS, 0)?;
    let header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let half = |m: u64, hi: bool| if hi { (m >> 32) as u32 } else { m as u32 };
    let data = [false, true].map(|hi| CapData {
        effective: half(sets.effective, hi),
        permitted: half(sets.permitted, hi),
        inheritable: half(sets.inheritable, hi),
    });
    // SAFETY: capset with a valid version-3 header and the two data
    // structs that version takes; the kernel only reads them.
    let r = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) };
    if r < 0 {
        return Err(format!(
            "capset (effective {:#x}, permitted {:#x}, inheritable {:#x}): {}",
            sets.effective,
            sets.permitted,
            sets.inheritable,
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: prctl with integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if r < 0 {
        return Err(format!(
            "clearing the ambient capabilities: {}",
            std::io::Error::last_os_error()
        ));
    }
    for cap in (0..64u8).filter(|c| sets.ambient & (1 << c) != 0) {
        // SAFETY: prctl with integer arguments only.
        let r = unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                libc::c_ulong::from(cap),
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        if r < 0 {
            return Err(format!(
                "raising ambient capability {cap} (it must also be permitted and inheritable): {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_from_a_process() {
        let p: Process = serde_json::from_str(
            r#"{"args":["x"],"cwd":"/","user":{"uid":0,"gid":0},
                "capabilities":{"bounding":["CAP_CHOWN","CAP_NET_BIND_SERVICE"],
                "effective":["CAP_NET_BIND_SERVICE"],"ambient":["CAP_CHECKPOINT_RESTORE"]}}"#,
        )
        .unwrap();
        let s = CapSets::of(&p);
        assert_eq!(s.bounding, 1 | 1 << 10);
        assert_eq!(s.effective, 1 << 10);
        assert_eq!(s.permitted, 0);
        assert_eq!(s.ambient, 1 << 40);
        let bare: Process =
            serde_json::from_str(r#"{"args":["x"],"cwd":"/","user":{"uid":0,"gid":0}}"#).unwrap();
        assert_eq!(CapSets::of(&bare), CapSets::default());
    }

    #[test]
    fn numbers_match_the_kernel_headers() {
        let header = std::fs::read_to_string("/usr/include/linux/capability.h")
            .expect("linux/capability.h (linux-libc-dev) is needed by this test");
        let mut seen = 0;
        for line in header.lines() {
            let mut words = line.split_whitespace();
            let (Some("#define"), Some(name), Some(value)) =
                (words.next(), words.next(), words.next())
            else {
                continue;
            };
            let Ok(value) = value.parse::<u8>() else {
                continue;
            };
            if !name.starts_with("CAP_") || name == "CAP_LAST_CAP" {
                continue;
            }
            let cap: Capability = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(number(cap), value, "{name}");
            seen += 1;
        }
        assert_eq!(seen, 41, "capabilities in the header");
    }
}
