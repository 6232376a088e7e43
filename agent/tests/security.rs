//! The security context of real containers (as root, through the agent
//! binary): capabilities, seccomp, user and groups, read-only rootfs,
//! masked and read-only paths, sysctls, /dev/shm, and what is refused.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Agent, Image, T};
use serde_json::{json, Value};
use twig_agent::client::{AgentClient, Stream};
use twig_agent::testkit::{process, spec, DEFAULT_CAPS};

/// The testkit's namespaces plus a network namespace of its own, so that
/// binding ports and net sysctls stay inside the container.
fn own_net() -> Value {
    json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}])
}

/// Runs a container to its end; (exit status, stdout + stderr).
fn run(c: &AgentClient, image: &Image, id: &str, script: &str, extra: Value) -> (i32, String) {
    let mut extra = extra;
    twig_agent::testkit::merge(&mut extra, json!({"linux": {"namespaces": own_net()}}));
    c.create_container(
        id,
        &image.device,
        false,
        &spec(&["sh", "-c", script], extra),
        T,
    )
    .unwrap();
    c.start_container(id, T).unwrap();
    let out = c.read_to_end(id, "", Stream::Stdout, T).unwrap();
    let err = c.read_to_end(id, "", Stream::Stderr, T).unwrap();
    let status = c.wait_exit(id, "", T).unwrap().status;
    c.remove_container(id, T).unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&err)
    );
    (status, text)
}

/// Prints `chown=ok|denied`, `bind=ok|denied` (port 80) and the process's
/// capability sets. A successful listener is stopped by `timeout` after a
/// second (the window in which it would have failed to bind).
const PRIVILEGE_PROBE: &str = "touch /tmp/f; \
    if chown 1:1 /tmp/f 2>/dev/null; then echo chown=ok; else echo chown=denied; fi; \
    if timeout 1 nc -l -p 80 2>&1 | grep -q 'Permission denied'; then echo bind=denied; else echo bind=ok; fi; \
    grep ^Cap /proc/self/status";

fn caps(sets: &[&str], names: &[&str]) -> Value {
    let mut m = serde_json::Map::new();
    for s in [
        "bounding",
        "effective",
        "permitted",
        "inheritable",
        "ambient",
    ] {
        m.insert(s.into(), json!(if sets.contains(&s) { names } else { &[] }));
    }
    Value::Object(m)
}

fn cap_line(text: &str, set: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{set}:\t")))
        .unwrap_or_else(|| panic!("no {set} in {text}"))
        .to_string()
}

#[test]
fn capabilities_as_runc_applies_them() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();

    // containerd's default set: root may chown and bind port 80.
    let (status, text) = run(&c, &image, "defaults", PRIVILEGE_PROBE, json!({}));
    assert_eq!(status, 0, "{text}");
    assert!(
        text.contains("chown=ok") && text.contains("bind=ok"),
        "{text}"
    );
    assert_eq!(cap_line(&text, "CapEff"), "00000000a80425fb", "{text}");
    assert_eq!(cap_line(&text, "CapBnd"), "00000000a80425fb", "{text}");

    // All dropped: root, but neither chown nor port 80.
    let all_dropped = json!({"process": {"capabilities": caps(&[], &[])}});
    let (_, text) = run(&c, &image, "dropped", PRIVILEGE_PROBE, all_dropped);
    assert!(
        text.contains("chown=denied") && text.contains("bind=denied"),
        "{text}"
    );
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(cap_line(&text, set), "0000000000000000", "{set}: {text}");
    }

    // No `capabilities` at all means none (runc's rule).
    let (_, text) = run(
        &c,
        &image,
        "absent",
        PRIVILEGE_PROBE,
        json!({"process": {"capabilities": null}}),
    );
    assert!(
        text.contains("chown=denied") && text.contains("bind=denied"),
        "{text}"
    );

    // Non-root with CAP_NET_BIND_SERVICE in every set: ambient carries it
    // across exec, so port 80 binds; nothing else is there.
    let nbs = json!({"process": {
        "user": {"uid": 1000, "gid": 1000},
        "capabilities": caps(
            &["bounding", "effective", "permitted", "inheritable", "ambient"],
            &["CAP_NET_BIND_SERVICE"],
        ),
    }});
    let (_, text) = run(&c, &image, "nbs", &format!("id -u; {PRIVILEGE_PROBE}"), nbs);
    assert!(text.starts_with("1000\n"), "{text}");
    assert!(
        text.contains("bind=ok") && text.contains("chown=denied"),
        "{text}"
    );
    assert_eq!(cap_line(&text, "CapAmb"), "0000000000000400", "{text}");
    assert_eq!(cap_line(&text, "CapEff"), "0000000000000400", "{text}");
    assert_eq!(cap_line(&text, "CapBnd"), "0000000000000400", "{text}");

    // Non-root with the default set but no ambient: exec clears them.
    let user = json!({"process": {"user": {"uid": 1000, "gid": 1000}}});
    let (_, text) = run(&c, &image, "nonroot", PRIVILEGE_PROBE, user);
    assert!(text.contains("bind=denied"), "{text}");
    assert_eq!(cap_line(&text, "CapEff"), "0000000000000000", "{text}");
    assert_eq!(cap_line(&text, "CapBnd"), "00000000a80425fb", "{text}");

    // An exec gets its own process's capabilities.
    let id = "execs";
    c.create_container(
        id,
        &image.device,
        false,
        &spec(&["sleep", "1000"], json!({})),
        T,
    )
    .unwrap();
    c.start_container(id, T).unwrap();
    let p = process(
        &["grep", "CapEff", "/proc/self/status"],
        json!({"capabilities": caps(&["bounding", "effective", "permitted"], &["CAP_KILL"])}),
    );
    c.exec_process(id, "e", &p, T).unwrap();
    let out = c.read_to_end(id, "e", Stream::Stdout, T).unwrap();
    assert_eq!(String::from_utf8_lossy(&out), "CapEff:\t0000000000000020\n");
    c.remove_container(id, T).unwrap();
}

/// A static probe (C, built with the system compiler): `probe <call>`
/// makes one system call and prints `ok` or `errno=N`.
fn build_probe(dir: &Path) -> PathBuf {
    let src = dir.join("probe.c");
    std::fs::write(
        &src,
        r#"#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
    long r = -1;
    if (argc < 2) return 2;
    if (!strcmp(argv[1], "keyctl")) r = syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -3 /* session */, 1);
    else if (!strcmp(argv[1], "clone3")) r = syscall(SYS_clone3, NULL, 0);
    else if (!strcmp(argv[1], "personality-query")) r = syscall(SYS_personality, 0xffffffffUL);
    else if (!strcmp(argv[1], "personality-set")) r = syscall(SYS_personality, 0x0040000UL);
    else if (!strcmp(argv[1], "getcpu")) { unsigned cpu; r = syscall(SYS_getcpu, &cpu, NULL, NULL); }
    else return 2;
    if (r < 0) printf("errno=%d\n", errno); else printf("ok\n");
    return 0;
}
"#,
    )
    .unwrap();
    let out = dir.join("probe");
    common::run_cmd(
        Command::new("cc")
            .args(["-static", "-O", "-o"])
            .arg(&out)
            .arg(&src),
    );
    out
}

/// containerd's RuntimeDefault profile as CRI hands it to a runtime: a
/// default ERRNO(EPERM), an allow list of everything but the dangerous
/// calls, `personality` only with harmless arguments, `clone` only without
/// namespace flags, `clone3` as ENOSYS, and names of other architectures.
fn runtime_default_profile() -> Value {
    const BLOCKED: &[&str] = &[
        "acct",
        "add_key",
        "bpf",
        "clock_adjtime",
        "clock_settime",
        "clone",
        "clone3",
        "create_module",
        "delete_module",
        "finit_module",
        "get_kernel_syms",
        "get_mempolicy",
        "init_module",
        "ioperm",
        "iopl",
        "kcmp",
        "kexec_file_load",
        "kexec_load",
        "keyctl",
        "lookup_dcookie",
        "mbind",
        "mount",
        "move_pages",
        "name_to_handle_at",
        "nfsservctl",
        "open_by_handle_at",
        "perf_event_open",
        "personality",
        "pivot_root",
        "process_vm_readv",
        "process_vm_writev",
        "ptrace",
        "query_module",
        "quotactl",
        "reboot",
        "request_key",
        "set_mempolicy",
        "setns",
        "settimeofday",
        "swapon",
        "swapoff",
        "sysfs",
        "_sysctl",
        "umount2",
        "unshare",
        "uselib",
        "userfaultfd",
        "ustat",
        "vm86",
        "vm86old",
        "fsconfig",
        "fsmount",
        "fsopen",
        "fspick",
        "open_tree",
        "move_mount",
        "mount_setattr",
        "syslog",
    ];
    let header = std::fs::read_to_string("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
        .expect("asm/unistd_64.h (linux-libc-dev)");
    let mut allowed: Vec<&str> = header
        .lines()
        .filter_map(|l| l.strip_prefix("#define __NR_"))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| !BLOCKED.contains(n))
        .collect();
    // Names other architectures have: skipped on x86_64.
    allowed.extend(["_llseek", "arm_fadvise64_64", "ugetrlimit", "socketcall"]);
    let personality = [0u64, 8, 131072, 131080, 4294967295].map(|v| {
        json!({"names": ["personality"], "action": "SCMP_ACT_ALLOW",
               "args": [{"index": 0, "value": v, "op": "SCMP_CMP_EQ"}]})
    });
    let mut syscalls = vec![json!({"names": allowed, "action": "SCMP_ACT_ALLOW"})];
    syscalls.extend(personality);
    syscalls.push(json!({"names": ["clone"], "action": "SCMP_ACT_ALLOW",
        "args": [{"index": 0, "value": 2114060288u64, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]}));
    syscalls.push(json!({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}));
    json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": syscalls,
    })
}

#[test]
fn runtime_default_seccomp_blocks_unshare_and_keyctl() {
    let dir = tempfile::tempdir().unwrap();
    let probe = build_probe(dir.path());
    let image = Image::with_programs(&[(&probe, "probe")]);
    let agent = Agent::start();
    let c = agent.client();
    // CAP_SYS_ADMIN is granted so that only the filter can say no.
    let mut admin: Vec<&str> = DEFAULT_CAPS.to_vec();
    admin.push("CAP_SYS_ADMIN");
    let admin_caps = json!({"bounding": admin, "effective": admin, "permitted": admin});
    let script = "unshare -u true 2>&1 && echo unshare=ok; \
        for call in keyctl clone3 personality-query personality-set; do echo $call $(probe $call); done; \
        echo forked $(sh -c 'echo child')";

    let (status, text) = run(
        &c,
        &image,
        "unfiltered",
        script,
        json!({"process": {"capabilities": admin_caps}}),
    );
    assert_eq!(status, 0, "{text}");
    assert!(text.contains("unshare=ok"), "{text}");
    assert!(text.contains("keyctl ok"), "{text}");
    assert!(text.contains("personality-set ok"), "{text}");

    let filtered = json!({
        "process": {"capabilities": admin_caps},
        "linux": {"seccomp": runtime_default_profile()},
    });
    let (status, text) = run(&c, &image, "filtered", script, filtered);
    assert_eq!(status, 0, "{text}");
    assert!(
        text.contains("unshare: unshare(0x4000000): Operation not permitted"),
        "{text}"
    );
    assert!(!text.contains("unshare=ok"), "{text}");
    assert!(text.contains("keyctl errno=1\n"), "{text}");
    // The rule's own errno; argument conditions; clone without namespace
    // flags (fork) still works.
    assert!(text.contains("clone3 errno=38\n"), "{text}");
    assert!(text.contains("personality-query ok\n"), "{text}");
    assert!(text.contains("personality-set errno=1\n"), "{text}");
    assert!(text.contains("forked child\n"), "{text}");

    // Without no_new_privs the filter goes on while CAP_SYS_ADMIN still
    // allows it (before the capabilities are dropped); execs (here too
    // without no_new_privs) get the container's filter.
    let id = "exec-filtered";
    let s = spec(
        &["sleep", "1000"],
        json!({"process": {"noNewPrivileges": false},
               "linux": {"seccomp": runtime_default_profile()}}),
    );
    c.create_container(id, &image.device, false, &s, T).unwrap();
    c.start_container(id, T).unwrap();
    let (_, out, _) = c.run(id, "k", &["probe", "keyctl"], T).unwrap();
    assert_eq!(out, b"errno=1\n");
    let (_, out, _) = c
        .run(
            id,
            "status",
            &["grep", "-E", "^(Seccomp|NoNewPrivs):", "/proc/1/status"],
            T,
        )
        .unwrap();
    assert_eq!(out, b"NoNewPrivs:\t0\nSeccomp:\t2\n");
    c.remove_container(id, T).unwrap();

    // A kill action kills (SIGSYS); a log action allows.
    let kill = json!({"linux": {"seccomp": {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [{"names": ["getcpu"], "action": "SCMP_ACT_KILL_PROCESS"},
                     {"names": ["keyctl"], "action": "SCMP_ACT_LOG"}]}}});
    let (status, text) = run(&c, &image, "kill", "probe keyctl; exec probe getcpu", kill);
    assert_eq!(status, 128 + 31, "{text}");
    assert_eq!(text, "ok\n");
}

#[test]
fn user_groups_and_umask() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let user = json!({"process": {"user": {
        "uid": 1000, "gid": 1001, "additionalGids": [2000, 3000], "umask": 63}}});
    let (status, text) = run(
        &c,
        &image,
        "user",
        "id -u; id -g; id -G; umask; touch /tmp/x; stat -c %a /tmp/x",
        user,
    );
    assert_eq!(status, 0, "{text}");
    assert_eq!(text, "1000\n1001\n1001 2000 3000\n0077\n600\n");
}

#[test]
fn read_only_rootfs_paths_sysctls_and_shm() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let host_rmid = std::fs::read_to_string("/proc/sys/kernel/shm_rmid_forced").unwrap();
    let extra = json!({
        "root": {"path": "rootfs", "readonly": true},
        "process": {"user": {"uid": 1000, "gid": 1000}, "capabilities": caps(&[], &[])},
        "linux": {
            "sysctl": {"net.ipv4.ip_unprivileged_port_start": "80", "kernel.shm_rmid_forced": "1"},
            "maskedPaths": ["/proc/timer_list", "/sys/firmware", "/etc/twig-marker"],
        },
    });
    let script = "touch /x 2>&1; touch /tmp/ok && echo tmp=writable; \
        echo marker=$(cat /etc/twig-marker | wc -c); echo timer_list=$(cat /proc/timer_list | wc -c); \
        echo firmware=$(ls -A /sys/firmware | wc -l); \
        echo rmid=$(cat /proc/sys/kernel/shm_rmid_forced) port=$(cat /proc/sys/net/ipv4/ip_unprivileged_port_start); \
        grep -q ' /proc/sys ro,' /proc/self/mountinfo && echo procsys=read-only; \
        if timeout 1 nc -l -p 80 2>&1 | grep -q 'Permission denied'; then echo bind=denied; else echo bind=ok; fi; \
        df -k /dev/shm | tail -n 1";
    let (_, text) = run(&c, &image, "ro", script, extra);
    assert!(text.contains("touch: /x: Read-only file system"), "{text}");
    assert!(text.contains("tmp=writable"), "{text}");
    assert!(text.contains("marker=0\n"), "{text}");
    assert!(text.contains("timer_list=0\n"), "{text}");
    assert!(text.contains("firmware=0\n"), "{text}");
    assert!(text.contains("rmid=1 port=80\n"), "{text}");
    assert!(text.contains("procsys=read-only"), "{text}");
    // No capabilities, but the namespaced sysctl opened port 80.
    assert!(text.contains("bind=ok"), "{text}");
    let shm = text
        .lines()
        .find(|l| l.ends_with(" /dev/shm"))
        .unwrap_or_default();
    assert_eq!(shm.split_whitespace().nth(1), Some("65536"), "{text}");
    // The host's own value did not change.
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/shm_rmid_forced").unwrap(),
        host_rmid
    );
}

#[test]
fn what_cannot_be_honoured_is_refused_before_anything_starts() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let cases = [
        (
            json!({"process": {"capabilities": {"bounding": ["CAP_CHOWN", "CAP_BOGUS"]}}}),
            "CAP_BOGUS",
        ),
        (
            json!({"linux": {"seccomp": {"defaultAction": "SCMP_ACT_NOTIFY"}}}),
            "SCMP_ACT_NOTIFY is not supported",
        ),
        (
            json!({"linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW",
                "listenerPath": "/run/seccomp.sock"}}}),
            "listenerPath",
        ),
        (
            json!({"linux": {"sysctl": {"kernel.panic": "1"}}}),
            "\"kernel.panic\" is not namespaced",
        ),
    ];
    for (extra, want) in cases {
        let e = c
            .create_container("refused", &image.device, false, &spec(&["true"], extra), T)
            .unwrap_err();
        assert_eq!(e.status_code(), Some("INVALID_ARGUMENT"), "{e}");
        assert!(e.to_string().contains(want), "{want}: {e}");
        // Nothing was created: no container, no mount.
        let e = c.stats("refused", T).unwrap_err();
        assert_eq!(e.status_code(), Some("NOT_FOUND"), "{e}");
        assert!(!agent
            .mountinfo()
            .contains(&common::path_str(&agent.rootfs_path("refused"))));
    }
    // An exec with an unknown capability is refused too, and nothing runs.
    let id = "running";
    c.create_container(
        id,
        &image.device,
        false,
        &spec(&["sleep", "1000"], json!({})),
        T,
    )
    .unwrap();
    c.start_container(id, T).unwrap();
    let p = process(
        &["true"],
        json!({"capabilities": {"effective": ["CAP_NOPE"]}}),
    );
    let e = c.exec_process(id, "bad", &p, T).unwrap_err();
    assert!(e.to_string().contains("CAP_NOPE"), "{e}");
    assert_eq!(c.stats(id, T).unwrap().process_count, 1);
    c.remove_container(id, T).unwrap();
}
