//! The privileges a container's processes keep, as a container runtime sets
//! them before the program runs: the capability bounding set (the runtime's
//! default set, less `securityContext.capabilities.drop`, plus `add`, which the
//! node policy allows only where it says so), an empty ambient set,
//! `no_new_privs` when `allowPrivilegeEscalation: false`, and a seccomp filter
//! that refuses what containerd's RuntimeDefault profile refuses a container
//! without CAP_SYS_ADMIN: making or entering namespaces, mounting, loading
//! kernel modules or BPF programs, keyrings, setting the clock, rebooting.
//!
//! The launcher applies them as root, just before it drops to the run-as
//! user (`launch`), so the program and everything it starts hold them from
//! their first instruction. The filter is installed while the launcher still
//! has CAP_SYS_ADMIN, so it does not need `no_new_privs`, and a Pod that
//! allows privilege escalation can still run a setuid program its image maps
//! (one not owned by root: the host's tree is mounted `nosuid`).

use std::collections::BTreeMap;

use rustix::thread::CapabilitySet;
use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};
use vkd_provider::SecurityContext;

/// Why the privileges could not be set.
#[derive(Debug, thiserror::Error)]
pub enum HardeningError {
    #[error("dropping capability {cap} from the bounding set: {source}")]
    Bounding { cap: u32, source: rustix::io::Errno },
    #[error("clearing the ambient capabilities: {0}")]
    Ambient(rustix::io::Errno),
    #[error("setting no_new_privs: {0}")]
    NoNewPrivs(rustix::io::Errno),
    #[error("building the seccomp filter: {0}")]
    Filter(String),
    #[error("installing the seccomp filter: {0}")]
    Seccomp(std::io::Error),
}

/// The capabilities a container runtime (containerd, CRI-O, Docker) leaves in
/// a container's bounding set by default.
pub const RUNTIME_DEFAULT: CapabilitySet = CapabilitySet::CHOWN
    .union(CapabilitySet::DAC_OVERRIDE)
    .union(CapabilitySet::FSETID)
    .union(CapabilitySet::FOWNER)
    .union(CapabilitySet::MKNOD)
    .union(CapabilitySet::NET_RAW)
    .union(CapabilitySet::SETGID)
    .union(CapabilitySet::SETUID)
    .union(CapabilitySet::SETFCAP)
    .union(CapabilitySet::SETPCAP)
    .union(CapabilitySet::NET_BIND_SERVICE)
    .union(CapabilitySet::SYS_CHROOT)
    .union(CapabilitySet::KILL)
    .union(CapabilitySet::AUDIT_WRITE);

/// A capability by the name a Pod gives it (`NET_RAW`, `CAP_NET_RAW`,
/// `net_raw`), as runtimes read them; `None` for a name no kernel knows.
pub fn capability(name: &str) -> Option<CapabilitySet> {
    let upper = name.trim().to_ascii_uppercase();
    let bare = upper.strip_prefix("CAP_").unwrap_or(&upper);
    CapabilitySet::all()
        .iter_names()
        .find(|(n, _)| *n == bare)
        .map(|(_, c)| c)
}

/// What a launch applies before it runs a Pod's program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Privileges {
    /// The bounding set kept.
    pub bounding: CapabilitySet,
    /// `no_new_privs`: setuid bits and file capabilities give nothing.
    pub no_new_privs: bool,
}

impl Default for Privileges {
    fn default() -> Self {
        Self {
            bounding: RUNTIME_DEFAULT,
            no_new_privs: false,
        }
    }
}

impl Privileges {
    /// As the kubelet asks a runtime for them: the default set less `drop`
    /// (`ALL` drops every one) plus `add`; `no_new_privs` when the container
    /// says `allowPrivilegeEscalation: false`. Unknown names change nothing
    /// (the runtime refuses them; here they can only narrow nothing).
    /// No securityContext is the runtime's defaults.
    pub fn of(sc: Option<&SecurityContext>) -> Self {
        let default = SecurityContext::default();
        let sc = sc.unwrap_or(&default);
        let named = |names: &[String]| -> (bool, CapabilitySet) {
            let all = names.iter().any(|n| n.trim().eq_ignore_ascii_case("ALL"));
            let set = names
                .iter()
                .filter_map(|n| capability(n))
                .fold(CapabilitySet::empty(), |a, c| a | c);
            (all, set)
        };
        let (drop_all, dropped) = named(&sc.drop_capabilities);
        let (add_all, added) = named(&sc.add_capabilities);
        let mut bounding = if drop_all {
            CapabilitySet::empty()
        } else {
            RUNTIME_DEFAULT - dropped
        };
        bounding |= added;
        if add_all || sc.privileged {
            bounding = CapabilitySet::all();
        }
        Self {
            bounding,
            no_new_privs: sc.allow_privilege_escalation == Some(false),
        }
    }

    /// As a launcher flag value.
    pub fn to_arg(self) -> String {
        format!("{:x}:{}", self.bounding.bits(), u8::from(self.no_new_privs))
    }

    /// From a launcher flag value.
    pub fn from_arg(arg: &str) -> Option<Self> {
        let (caps, nnp) = arg.split_once(':')?;
        Some(Self {
            bounding: CapabilitySet::from_bits_retain(u64::from_str_radix(caps, 16).ok()?),
            no_new_privs: match nnp {
                "0" => false,
                "1" => true,
                _ => return None,
            },
        })
    }

    /// Narrows the calling process (single-threaded, still root): the
    /// bounding set, the ambient set, then the seccomp filter. `no_new_privs`
    /// comes after the identity changes ([`Self::finish`]).
    pub fn apply(self) -> Result<(), HardeningError> {
        for bit in 0..64u32 {
            let cap = CapabilitySet::from_bits_retain(1 << bit);
            if self.bounding.contains(cap) {
                continue;
            }
            match rustix::thread::capability_is_in_bounding_set(cap) {
                Ok(true) => rustix::thread::remove_capability_from_bounding_set(cap)
                    .map_err(|source| HardeningError::Bounding { cap: bit, source })?,
                Ok(false) => {}
                // Past the kernel's last capability.
                Err(_) => break,
            }
        }
        rustix::thread::clear_ambient_capability_set().map_err(HardeningError::Ambient)?;
        install(&filter()?)
    }

    /// The last step, as the run-as user, before the program runs.
    pub fn finish(self) -> Result<(), HardeningError> {
        if self.no_new_privs {
            rustix::thread::set_no_new_privs(true).map_err(HardeningError::NoNewPrivs)?;
        }
        Ok(())
    }
}

/// The system calls refused outright (EPERM), as RuntimeDefault refuses them
/// to a container without CAP_SYS_ADMIN and the like.
fn refused_syscalls() -> Vec<i64> {
    vec![
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_move_mount,
        libc::SYS_open_tree,
        libc::SYS_mount_setattr,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_reboot,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_acct,
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_clock_adjtime,
        libc::SYS_adjtimex,
        libc::SYS_syslog,
        libc::SYS_quotactl,
        libc::SYS_lookup_dcookie,
        libc::SYS_vhangup,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_iopl,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_ioperm,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_uselib,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_ustat,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_sysfs,
        #[cfg(target_arch = "x86_64")]
        libc::SYS__sysctl,
    ]
}

/// clone's namespace flags: a new one of any kind is refused, as unshare is.
const NAMESPACE_FLAGS: [u64; 7] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWCGROUP as u64,
];

/// The filters, in the order installed: the refusals (EPERM), then clone3,
/// whose flags live in memory a filter cannot read, answered ENOSYS so that
/// libc falls back to clone, whose flags the first filter checks.
fn filter() -> Result<Vec<seccompiler::BpfProgram>, HardeningError> {
    let bad = |e: seccompiler::BackendError| HardeningError::Filter(e.to_string());
    let arch = seccompiler::TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| HardeningError::Filter(format!("{e:?}")))?;
    let mut refused: BTreeMap<i64, Vec<SeccompRule>> = refused_syscalls()
        .into_iter()
        .map(|nr| (nr, Vec::new()))
        .collect();
    // clone's flags are its first argument on x86_64 and aarch64 alike.
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|flag| {
            SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(*flag),
                *flag,
            )
            .and_then(|c| SeccompRule::new(vec![c]))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(bad)?;
    refused.insert(libc::SYS_clone, clone_rules);
    let errno = |e: i32| SeccompAction::Errno(u32::try_from(e).unwrap_or(1));
    let first =
        SeccompFilter::new(refused, SeccompAction::Allow, errno(libc::EPERM), arch).map_err(bad)?;
    let clone3: BTreeMap<i64, Vec<SeccompRule>> = [(libc::SYS_clone3, Vec::new())].into();
    let second =
        SeccompFilter::new(clone3, SeccompAction::Allow, errno(libc::ENOSYS), arch).map_err(bad)?;
    let mut out = Vec::new();
    for f in [first, second] {
        out.push(
            seccompiler::BpfProgram::try_from(f)
                .map_err(|e| HardeningError::Filter(e.to_string()))?,
        );
    }
    Ok(out)
}

/// Installs the filters on the calling thread (the launcher is single-threaded).
#[allow(unsafe_code)]
fn install(programs: &[seccompiler::BpfProgram]) -> Result<(), HardeningError> {
    #[repr(C)]
    struct SockFprog {
        len: libc::c_ushort,
        filter: *const seccompiler::sock_filter,
    }
    const SECCOMP_SET_MODE_FILTER: libc::c_ulong = 1;
    for p in programs {
        let prog = SockFprog {
            len: libc::c_ushort::try_from(p.len())
                .map_err(|_| HardeningError::Filter("the filter is too long".into()))?,
            filter: p.as_ptr(),
        };
        // SAFETY: `prog` points at `p`'s instructions, both alive for the
        // call; the kernel copies the program and keeps no pointer to it.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                SECCOMP_SET_MODE_FILTER,
                0 as libc::c_ulong,
                &prog as *const SockFprog,
            )
        };
        if rc != 0 {
            return Err(HardeningError::Seccomp(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    fn sc(drop: &[&str], add: &[&str], escalation: Option<bool>) -> SecurityContext {
        SecurityContext {
            allow_privilege_escalation: escalation,
            drop_capabilities: drop.iter().map(|s| (*s).to_owned()).collect(),
            add_capabilities: add.iter().map(|s| (*s).to_owned()).collect(),
            privileged: false,
        }
    }

    #[test]
    fn the_runtime_default_less_drop_plus_add() {
        let none = Privileges::of(None);
        assert_eq!(none.bounding, RUNTIME_DEFAULT);
        assert!(!none.no_new_privs);
        assert!(!none.bounding.contains(CapabilitySet::SYS_ADMIN));
        let all = Privileges::of(Some(&sc(&["ALL"], &[], Some(false))));
        assert_eq!(all.bounding, CapabilitySet::empty());
        assert!(all.no_new_privs);
        let some = Privileges::of(Some(&sc(&["net_raw", "CAP_KILL"], &["NET_ADMIN"], None)));
        assert!(!some.bounding.contains(CapabilitySet::NET_RAW));
        assert!(!some.bounding.contains(CapabilitySet::KILL));
        assert!(
            some.bounding
                .contains(CapabilitySet::NET_ADMIN | CapabilitySet::CHOWN)
        );
        // drop ALL, add one: only that one, as runtimes do.
        let one = Privileges::of(Some(&sc(&["ALL"], &["NET_BIND_SERVICE"], None)));
        assert_eq!(one.bounding, CapabilitySet::NET_BIND_SERVICE);
        assert_eq!(capability("bogus"), None);
    }

    #[test]
    fn the_flag_round_trips_and_bad_ones_are_refused() {
        let p = Privileges::of(Some(&sc(&["ALL"], &["KILL"], Some(false))));
        assert_eq!(Privileges::from_arg(&p.to_arg()), Some(p));
        for bad in ["", "zz:0", "ff", "ff:2"] {
            assert_eq!(Privileges::from_arg(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_filters_compile_for_this_machine() {
        let f = filter().unwrap();
        assert_eq!(f.len(), 2);
        assert!(f.iter().all(|p| !p.is_empty()));
    }

    /// In a child process (the filter cannot be removed): unshare and a
    /// clone with a namespace flag are refused, an ordinary fork is not.
    #[test]
    fn a_filtered_process_makes_no_namespace() {
        if !rustix::process::geteuid().is_root() {
            // Installing without no_new_privs needs CAP_SYS_ADMIN.
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["--exact", "hardening::tests::filtered_child", "--nocapture"])
            .env("VKD_FILTERED_CHILD", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("filtered child ok"), "{text}");
    }

    /// Runs only as the child of the test above.
    #[test]
    fn filtered_child() {
        if std::env::var_os("VKD_FILTERED_CHILD").is_none() {
            return;
        }
        Privileges::default().apply().unwrap();
        #[allow(unsafe_code)]
        // SAFETY: NEWUSER is refused by the filter before the kernel acts.
        let refused =
            unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWUSER) };
        assert_eq!(refused, Err(rustix::io::Errno::PERM));
        let status = std::process::Command::new("true").status().unwrap();
        assert!(status.success());
        let unshare = std::process::Command::new("unshare")
            .args(["-U", "true"])
            .status();
        if let Ok(s) = unshare {
            assert!(!s.success(), "unshare -U ran under the filter");
        }
        assert!(!rustix::thread::capability_is_in_bounding_set(CapabilitySet::SYS_ADMIN).unwrap());
        println!("filtered child ok");
    }
}
