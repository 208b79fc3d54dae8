//! The sandbox as a boundary (where the tests run as root, with namespaces):
//! each attack a hostile tenant tried on a process node, scripted with its
//! Pod spec, and what the tenant now sees. A setuid-root program of the host
//! gives nothing, the container's securityContext is applied, a namespace the
//! tenant makes is refused (and never entered by exec), PATH chooses no
//! mount, `kubectl debug` stays in the Pod, a memory emptyDir is bounded by
//! the Pod's memory limit, and two containers may mount different volumes at
//! one path.
#![allow(clippy::unwrap_used)] // a test file: a failed unwrap is a failed test

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::{fence, isolated, log_text, provider, remove, running, spec, stream_io, wait_for};
use tokio::io::AsyncReadExt;
use vkd_process::ProcessProvider;
use vkd_provider::{
    ContainerSpec, Mount, Provider, SecurityContext, Volume, VolumeFile, VolumeSource,
};

async fn exec(p: &ProcessProvider, uid: &str, container: &str, script: &str) -> (i32, String) {
    let (w, mut r) = tokio::io::duplex(1 << 16);
    let argv = vec!["sh".into(), "-c".into(), script.into()];
    let code = p
        .exec(uid, container, argv, stream_io(w, false))
        .await
        .unwrap();
    let mut out = String::new();
    r.read_to_string(&mut out).await.unwrap();
    (code, out)
}

/// Waits until the container's log holds `marker`, and returns it.
async fn logged(p: &ProcessProvider, uid: &str, container: &str, marker: &str) -> String {
    wait_for(marker, async || {
        let l = log_text(p, uid, container).await;
        l.contains(marker).then_some(l)
    })
    .await
}

/// A copy of `id` on the host, setuid and owned by `uid`, in a directory of
/// the host's tree outside /tmp (which a container has of its own).
fn setuid_id(uid: u32, tag: &str) -> (PathBuf, PathBuf) {
    let dir = PathBuf::from(format!("/var/tmp/vkd-suid-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let id = which("id");
    let copy = dir.join("id");
    std::fs::copy(&id, &copy).unwrap();
    std::os::unix::fs::chown(&copy, Some(uid), Some(uid)).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o4755)).unwrap();
    (dir, copy)
}

fn which(program: &str) -> PathBuf {
    ["/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(program))
        .find(|p| p.is_file())
        .unwrap()
}

fn status_field(status: &str, field: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or("")
        .trim()
        .to_owned()
}

/// A setuid-root program of the host's tree runs as the Pod's user, not as
/// root; the runtime's capability bounding set, seccomp and (where the Pod
/// forbids escalation) no_new_privs hold, in the program and in an exec.
#[tokio::test(flavor = "multi_thread")]
async fn a_setuid_root_program_of_the_host_gives_nothing_and_the_security_context_holds() {
    let Some((p, dir)) = isolated() else { return };
    let (suid_dir, suid) = setuid_id(0, "root");
    let uid = "u-boundary-suid";
    let script = format!(
        "echo euid=$({} -u); grep -E '^(NoNewPrivs|CapBnd|Seccomp):' /proc/self/status; \
         echo started; exec sleep 3701",
        suid.display()
    );
    let mut s = spec(uid, &["sh", "-c", &script]);
    s.containers[0].security = Some(Box::new(SecurityContext {
        allow_privilege_escalation: Some(false),
        drop_capabilities: vec!["ALL".into()],
        ..Default::default()
    }));
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = logged(&p, uid, "main", "started").await;
    assert!(log.contains("euid=65534"), "{log}");
    assert_eq!(status_field(&log, "NoNewPrivs"), "1", "{log}");
    assert_eq!(status_field(&log, "CapBnd"), "0000000000000000", "{log}");
    assert_eq!(status_field(&log, "Seccomp"), "2", "{log}");
    // exec gets the same.
    let (code, out) = exec(
        &p,
        uid,
        "main",
        &format!("echo euid=$({} -u); cat /proc/self/status", suid.display()),
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("euid=65534"), "{out}");
    assert_eq!(status_field(&out, "NoNewPrivs"), "1", "{out}");
    assert_eq!(status_field(&out, "CapBnd"), "0000000000000000", "{out}");
    assert_eq!(status_field(&out, "Seccomp"), "2", "{out}");
    remove(&p, uid).await;

    // Without a securityContext: the runtime's default set, escalation
    // allowed, and still no root from the host's setuid program (nosuid).
    let uid = "u-boundary-suid-default";
    let mut s = spec(uid, &["sh", "-c", &script]);
    s.containers[0].security = None;
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = logged(&p, uid, "main", "started").await;
    assert!(log.contains("euid=65534"), "{log}");
    assert_eq!(status_field(&log, "NoNewPrivs"), "0", "{log}");
    assert_eq!(status_field(&log, "CapBnd"), "00000000a80425fb", "{log}");
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(suid_dir);
}

/// A setuid program of the Pod's own image (one that root does not own)
/// works where a runtime would let it: escalation allowed; refused with
/// `allowPrivilegeEscalation: false`.
#[tokio::test(flavor = "multi_thread")]
async fn a_setuid_program_of_the_image_works_unless_escalation_is_forbidden() {
    let (probe, probe_dir) = provider();
    let namespaces = probe.isolation_mode() == "namespaces";
    drop(probe);
    let _ = std::fs::remove_dir_all(probe_dir);
    if !namespaces {
        eprintln!("no namespaces here (not root?): nothing to check");
        return;
    }
    let (suid_dir, suid) = setuid_id(4242, "image");
    let mut config = common::config();
    config.images[0].files = [("/image/id".into(), suid.clone())].into_iter().collect();
    let dir = std::env::temp_dir().join(format!("vkd-process-{}", uuid::Uuid::new_v4().simple()));
    let p = ProcessProvider::open(config, &dir, common::shim_exe()).unwrap();
    for (n, escalation, want) in [(0, None, "euid=4242"), (1, Some(false), "euid=65534")] {
        let uid = format!("u-boundary-image-suid-{n}");
        let mut s = spec(
            &uid,
            &["sh", "-c", "echo euid=$(/image/id -u); exec sleep 3702"],
        );
        s.containers[0].security = escalation.map(|e| {
            Box::new(SecurityContext {
                allow_privilege_escalation: Some(e),
                ..Default::default()
            })
        });
        p.create(&fence(), &s).await.unwrap();
        running(&p, &uid).await;
        let log = logged(&p, &uid, "main", "euid=").await;
        assert!(log.contains(want), "{escalation:?}: {log}");
        remove(&p, &uid).await;
    }
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(suid_dir);
}

/// `hostUsers: false`: the container's user namespace maps only the run-as
/// ids, so root does not exist in it (root's files read as the overflow id)
/// and no setuid-root program, even on a mount without nosuid, gives root;
/// an exec enters it too.
#[tokio::test(flavor = "multi_thread")]
async fn host_users_false_gives_a_user_namespace_without_root() {
    let Some((p, dir)) = isolated() else { return };
    if !p.user_namespaces() {
        eprintln!("no user namespaces on this kernel: nothing to check");
        let _ = std::fs::remove_dir_all(dir);
        return;
    }
    let uid = "u-boundary-userns";
    let script = "echo map=$(cat /proc/self/uid_map | tr -s ' ' | tr '\\n' ';'); \
                  echo root-owns=$(stat -c %u /etc/hostname /usr); echo mapped; exec sleep 3711";
    let mut s = spec(uid, &["sh", "-c", script]);
    s.user_namespace = true;
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = logged(&p, uid, "main", "mapped").await;
    assert!(log.contains("map= 65534 65534 1;"), "{log}");
    let overflow = std::fs::read_to_string("/proc/sys/kernel/overflowuid").unwrap();
    assert!(
        log.contains(&format!(
            "root-owns={} {}",
            overflow.trim(),
            overflow.trim()
        )),
        "{log}"
    );
    let (code, out) = exec(&p, uid, "main", "cat /proc/self/uid_map; id -u").await;
    assert_eq!(code, 0, "{out}");
    let words: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(words, ["65534", "65534", "1", "65534"], "{out}");
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// The tenant's trick: a user and mount namespace of its own (`unshare
/// -Urm`), then wait for an exec or an exec probe to enter it from the root
/// side. The namespace is refused at the source, and exec enters only what
/// vkd made and holds.
#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_the_tenant_makes_is_refused_and_exec_enters_only_vkds() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-boundary-unshare";
    let script = "unshare -Urm sh -c 'echo inside-own-namespace; sleep 1' 2>&1 \
                  || echo unshare-refused; echo done; exec sleep 3703";
    let mut s = spec(uid, &["sh", "-c", script]);
    s.containers[0].readiness_probe = Some(Box::new(vkd_provider::Probe {
        handler: vkd_provider::Handler::Exec {
            command: vec![
                "sh".into(),
                "-c".into(),
                "test \"$(hostname)\" = pod-boundary".into(),
            ],
        },
        initial_delay: std::time::Duration::ZERO,
        period: std::time::Duration::from_secs(1),
        timeout: std::time::Duration::from_secs(5),
        success_threshold: 1,
        failure_threshold: 3,
        termination_grace: None,
    }));
    s.pod.name = "pod-boundary".into();
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = logged(&p, uid, "main", "done").await;
    assert!(log.contains("unshare-refused"), "{log}");
    assert!(!log.contains("inside-own-namespace"), "{log}");
    // The exec lands in the container's own namespaces, as the Pod's user.
    let (code, out) = exec(
        &p,
        uid,
        "main",
        "echo $(id -u) $(hostname) $(cat /proc/1/cmdline | tr '\\0' ' ')",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.trim(), "65534 pod-boundary sleep 3703", "{out}");
    // The readiness probe ran there too.
    wait_for("the probe's readiness", async || {
        let i = p.get(uid).await.unwrap()?;
        i.containers.iter().any(|c| c.ready).then_some(())
    })
    .await;
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// `PATH=/tmp/../proc` and `PATH=/tmp/..<state>/pods` bound the host's /proc
/// and every Pod's sandbox into the container; a Pod's PATH now chooses
/// nothing that is mounted.
#[tokio::test(flavor = "multi_thread")]
async fn a_pods_path_chooses_no_mount() {
    let Some((p, dir)) = isolated() else { return };
    let other = "u-boundary-path-victim";
    let mut victim = spec(other, &["sleep", "3704"]);
    victim.volumes = vec![Volume {
        name: "secret".into(),
        source: VolumeSource::Files {
            files: vec![VolumeFile {
                path: "token".into(),
                data: b"victim-secret".to_vec(),
                mode: 0o644,
            }],
        },
    }];
    victim.containers[0].mounts = vec![Mount {
        volume: "secret".into(),
        path: "/secret".into(),
        sub_path: None,
        read_only: true,
    }];
    p.create(&fence(), &victim).await.unwrap();
    running(&p, other).await;
    let pods = std::fs::canonicalize(&dir).unwrap().join("pods");
    let uid = "u-boundary-path";
    let script = format!(
        "echo procs=$(ls /proc | grep -c '^[0-9]'); \
         echo pods=$(ls {pods} 2>/dev/null | wc -l); \
         cat {pods}/{other}/volumes/secret/token 2>/dev/null || echo no-secret; \
         echo checked; exec sleep 3705",
        pods = pods.display()
    );
    let mut s = spec(uid, &["sh", "-c", &script]);
    s.containers[0].env = vec![(
        "PATH".into(),
        format!("/tmp/../proc:/tmp/..{}:/usr/bin:/bin", pods.display()),
    )];
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = logged(&p, uid, "main", "checked").await;
    let procs: usize = log
        .lines()
        .find_map(|l| l.strip_prefix("procs="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap();
    assert!(procs <= 4, "the host's processes are in view: {log}");
    assert!(log.contains("pods=0"), "Pods' sandboxes are in view: {log}");
    assert!(log.contains("no-secret"), "{log}");
    assert!(!log.contains("victim-secret"), "{log}");
    remove(&p, uid).await;
    remove(&p, other).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// `kubectl debug` in one Pod reads nothing of another: the ephemeral
/// container has the Pod's namespaces, not the host's, and with
/// `targetContainerName` it sees its target's processes.
#[tokio::test(flavor = "multi_thread")]
async fn kubectl_debug_stays_in_its_pod() {
    let Some((p, dir)) = isolated() else { return };
    let victim = "u-boundary-debug-victim";
    let mut v = spec(victim, &["sleep", "3706"]);
    v.containers[0].env = vec![("VICTIM_SECRET".into(), "hunter2".into())];
    p.create(&fence(), &v).await.unwrap();
    running(&p, victim).await;
    let uid = "u-boundary-debug";
    p.create(&fence(), &spec(uid, &["sleep", "3707"]))
        .await
        .unwrap();
    running(&p, uid).await;
    let debugger = ContainerSpec {
        name: "debugger".into(),
        image: "busybox".into(),
        command: vec![
            "sh".into(),
            "-c".into(),
            "all=$(for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done); \
             echo target=$(echo \"$all\" | grep -c 'sleep 3707 $'); \
             echo victim=$(echo \"$all\" | grep -c 'sleep 3706 $'); \
             grep -l hunter2 /proc/*/environ 2>/dev/null || echo no-environ; \
             echo looked; exec sleep 3708"
                .into(),
        ],
        target_container: Some("main".into()),
        ..Default::default()
    };
    p.start_ephemeral(&fence(), uid, &debugger).await.unwrap();
    let state = wait_for("the debugger to start", async || {
        let i = p.get(uid).await.unwrap()?;
        let c = i
            .ephemeral_containers
            .into_iter()
            .find(|c| c.name == "debugger")?;
        (!matches!(c.state, vkd_provider::ContainerState::Waiting { .. })).then_some(c.state)
    })
    .await;
    assert!(
        matches!(state, vkd_provider::ContainerState::Running { .. }),
        "{state:?}"
    );
    let log = logged(&p, uid, "debugger", "looked").await;
    // Its target's program, never the other Pod's.
    assert!(log.contains("target=1"), "{log}");
    assert!(log.contains("victim=0"), "{log}");
    assert!(log.contains("no-environ"), "{log}");
    // exec into it is in its namespaces too: not the host's network or processes.
    let (code, out) = exec(&p, uid, "debugger", "ls /proc | grep -c '^[0-9]'").await;
    assert_eq!(code, 0, "{out}");
    assert!(out.trim().parse::<usize>().unwrap() < 10, "{out}");
    remove(&p, uid).await;
    remove(&p, victim).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A memory-backed emptyDir without sizeLimit is no bigger than the Pod's
/// memory limit (the kubelet's rule), so writing to it cannot take more of
/// the host's memory than the Pod may have.
#[tokio::test(flavor = "multi_thread")]
async fn a_memory_empty_dir_is_bounded_by_the_pods_memory_limit() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-boundary-tmpfs";
    let mut s = spec(
        uid,
        &[
            "sh",
            "-c",
            "dd if=/dev/zero of=/cache/fill bs=1M count=200 2>/dev/null; \
             echo wrote=$(( $(stat -c %s /cache/fill) / 1048576 )); exec sleep 3709",
        ],
    );
    s.volumes = vec![Volume {
        name: "cache".into(),
        source: VolumeSource::EmptyDir {
            size_limit: None,
            memory: true,
        },
    }];
    s.containers[0].mounts = vec![Mount {
        volume: "cache".into(),
        path: "/cache".into(),
        sub_path: None,
        read_only: false,
    }];
    s.containers[0].limits.memory_bytes = Some(64 << 20);
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = logged(&p, uid, "main", "wrote=").await;
    let wrote: u64 = log
        .lines()
        .find_map(|l| l.strip_prefix("wrote="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap();
    assert!(wrote <= 64, "{log}");
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Two containers mounting different volumes at one mountPath, as
/// Kubernetes allows: each sees its own.
#[tokio::test(flavor = "multi_thread")]
async fn two_containers_may_mount_different_volumes_at_one_path() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-boundary-same-path";
    let mut s = spec(uid, &["sh", "-c", "cat /data/which; echo; exec sleep 3710"]);
    let files = |name: &str| Volume {
        name: name.into(),
        source: VolumeSource::Files {
            files: vec![VolumeFile {
                path: "which".into(),
                data: name.as_bytes().to_vec(),
                mode: 0o644,
            }],
        },
    };
    s.volumes = vec![files("one"), files("two")];
    let mount = |v: &str| Mount {
        volume: v.into(),
        path: "/data".into(),
        sub_path: None,
        read_only: true,
    };
    s.containers[0].mounts = vec![mount("one")];
    let mut second = s.containers[0].clone();
    second.name = "second".into();
    second.mounts = vec![mount("two")];
    s.containers.push(second);
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    assert!(logged(&p, uid, "main", "one").await.starts_with("one"));
    assert!(logged(&p, uid, "second", "two").await.starts_with("two"));
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue 51, finding 1: an init container removed its emptyDir's directory
/// in the sandbox (bound into every container) and put a link to `/` there;
/// the next container's bind followed it, giving the host's `/` read-write.
/// Now no container sees the sandbox, the directory of volumes is root's,
/// and a volume's own name is never followed: the emptyDir stays the
/// emptyDir. Finding 9: a configMap, secret, downwardAPI or projected
/// volume is read-only, whatever the spec says.
#[tokio::test(flavor = "multi_thread")]
async fn a_link_where_a_volume_was_is_never_followed_and_api_volumes_are_read_only() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-boundary-volume-link";
    let sandbox = std::fs::canonicalize(&dir).unwrap().join("pods").join(uid);
    let plant = format!(
        "for v in {sb}/volumes/data \"$VKD_POD_ROOT/../volumes/data\"; do \
           rm -rf \"$v\" 2>/dev/null; ln -s / \"$v\" 2>/dev/null && echo \"planted $v\"; done; \
         echo sandbox=$(ls {sb} 2>/dev/null | wc -l); echo mine > /data/mine; echo planting-done",
        sb = sandbox.display()
    );
    let look = "ls -a /data | tr '\\n' ' '; echo; \
                (echo changed > /config/key) 2>/dev/null && echo config-written || echo config-read-only; \
                (touch /config/new) 2>/dev/null && echo config-file-made || echo config-file-refused; \
                cat /config/key; echo; echo looked; exec sleep 3711";
    let mut s = spec(uid, &["sh", "-c", look]);
    s.volumes = vec![
        Volume {
            name: "data".into(),
            source: VolumeSource::EmptyDir {
                size_limit: None,
                memory: false,
            },
        },
        Volume {
            name: "config".into(),
            source: VolumeSource::Files {
                files: vec![VolumeFile {
                    path: "key".into(),
                    data: b"from-the-api".to_vec(),
                    mode: 0o644,
                }],
            },
        },
    ];
    let mount = |volume: &str, path: &str| Mount {
        volume: volume.into(),
        path: path.into(),
        sub_path: None,
        read_only: false,
    };
    s.containers[0].mounts = vec![mount("data", "/data"), mount("config", "/config")];
    s.init_containers = vec![ContainerSpec {
        name: "plant".into(),
        image: "busybox".into(),
        command: vec!["sh".into(), "-c".into(), plant],
        mounts: vec![mount("data", "/data")],
        ..Default::default()
    }];
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let planted = logged(&p, uid, "plant", "planting-done").await;
    assert!(!planted.contains("planted"), "{planted}");
    assert!(
        planted.contains("sandbox=0"),
        "the sandbox is in view: {planted}"
    );
    let log = logged(&p, uid, "main", "looked").await;
    let listing = log.lines().next().unwrap_or_default();
    for host in ["etc", "proc", "usr"] {
        assert!(
            !listing.split_whitespace().any(|e| e == host),
            "the emptyDir shows the host's /: {listing}"
        );
    }
    assert!(listing.split_whitespace().any(|e| e == "mine"), "{log}");
    assert!(log.contains("config-read-only"), "{log}");
    assert!(log.contains("config-file-refused"), "{log}");
    assert!(log.contains("from-the-api"), "{log}");
    // The volume is still the directory vkd made, root's directory above it.
    use std::os::unix::fs::MetadataExt;
    let volumes = sandbox.join("volumes");
    assert!(volumes.join("data").symlink_metadata().unwrap().is_dir());
    assert_eq!(volumes.symlink_metadata().unwrap().uid(), 0);
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A mount point inside another volume (a configMap at /data/conf over an
/// emptyDir at /data) is made in the volume, by descriptors, as a runtime
/// makes it in its rootfs: the emptyDir stays the emptyDir (what the
/// container writes at its top reaches the other containers), and a link
/// the Pod put where the mount point goes is refused, never followed.
#[tokio::test(flavor = "multi_thread")]
async fn a_mount_inside_a_volume_is_made_in_it_and_never_through_a_link() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-boundary-nested";
    let mut s = spec(
        uid,
        &[
            "sh",
            "-c",
            "cat /data/conf/key; echo; echo from-main > /data/written && echo wrote; exec sleep 3712",
        ],
    );
    s.volumes = vec![
        Volume {
            name: "data".into(),
            source: VolumeSource::EmptyDir {
                size_limit: None,
                memory: false,
            },
        },
        Volume {
            name: "config".into(),
            source: VolumeSource::Files {
                files: vec![VolumeFile {
                    path: "key".into(),
                    data: b"nested-config".to_vec(),
                    mode: 0o644,
                }],
            },
        },
    ];
    let mount = |volume: &str, path: &str| Mount {
        volume: volume.into(),
        path: path.into(),
        sub_path: None,
        read_only: false,
    };
    s.containers[0].mounts = vec![mount("data", "/data"), mount("config", "/data/conf")];
    let mut reader = s.containers[0].clone();
    reader.name = "reader".into();
    reader.command = vec![
        "sh".into(),
        "-c".into(),
        "until test -f /data/written; do sleep 0.1; done; cat /data/written; exec sleep 3712"
            .into(),
    ];
    reader.mounts = vec![mount("data", "/data")];
    // A container whose mount point in the volume is a link the init
    // container planted: it does not start.
    let mut linked = s.containers[0].clone();
    linked.name = "linked".into();
    linked.command = vec![
        "sh".into(),
        "-c".into(),
        "ls /data/etc; exec sleep 3712".into(),
    ];
    linked.mounts = vec![mount("data", "/data"), mount("config", "/data/etc")];
    s.containers.push(reader);
    s.containers.push(linked);
    s.init_containers = vec![ContainerSpec {
        name: "plant".into(),
        image: "busybox".into(),
        command: vec!["sh".into(), "-c".into(), "ln -s /etc /data/etc".into()],
        mounts: vec![mount("data", "/data")],
        ..Default::default()
    }];
    p.create(&fence(), &s).await.unwrap();
    wait_for("the containers' status", async || {
        let i = p.get(uid).await.unwrap()?;
        (i.containers.len() == 3).then_some(())
    })
    .await;
    let main = logged(&p, uid, "main", "wrote").await;
    assert!(main.starts_with("nested-config"), "{main}");
    assert!(
        logged(&p, uid, "reader", "from-main")
            .await
            .contains("from-main")
    );
    let linked = logged(&p, uid, "linked", "a link").await;
    assert!(linked.contains("a link in the volume"), "{linked}");
    // The mount point was made in the volume itself, root's.
    let made = std::fs::canonicalize(&dir)
        .unwrap()
        .join("pods")
        .join(uid)
        .join("volumes/data/conf");
    assert!(made.is_dir(), "{}", made.display());
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A sandbox an older vkd made (its `volumes/` the Pod user's, the sandbox
/// open to every user and bound into each container by its plan) is
/// brought up to date when the provider opens, so a container that starts
/// again after an upgrade gets what a new one gets.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_an_older_vkd_made_is_brought_up_to_date_at_open() {
    use std::os::unix::fs::MetadataExt;
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-boundary-upgrade";
    let mut s = spec(uid, &["sleep", "3713"]);
    s.volumes = vec![Volume {
        name: "data".into(),
        source: VolumeSource::EmptyDir {
            size_limit: None,
            memory: false,
        },
    }];
    s.containers[0].mounts = vec![Mount {
        volume: "data".into(),
        path: "/data".into(),
        sub_path: None,
        read_only: false,
    }];
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let sb = std::fs::canonicalize(&dir).unwrap().join("pods").join(uid);
    // One this vkd made is left as it is by a restart.
    drop(p);
    let p = ProcessProvider::open(common::config(), &dir, common::shim_exe()).unwrap();
    assert_eq!(std::fs::metadata(&sb).unwrap().mode() & 0o777, 0o700);
    // What an older vkd left behind.
    std::os::unix::fs::lchown(sb.join("volumes"), Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&sb, std::fs::Permissions::from_mode(0o755)).unwrap();
    let plan_file = sb.join("mounts/0.json");
    let mut plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&plan_file).unwrap()).unwrap();
    plan["binds"].as_array_mut().unwrap().insert(
        0,
        serde_json::json!({"source": sb, "target": sb, "read_only": false}),
    );
    std::fs::write(&plan_file, serde_json::to_vec(&plan).unwrap()).unwrap();
    drop(p);
    let p = ProcessProvider::open(common::config(), &dir, common::shim_exe()).unwrap();
    assert_eq!(std::fs::metadata(sb.join("volumes")).unwrap().uid(), 0);
    assert_eq!(std::fs::metadata(&sb).unwrap().mode() & 0o777, 0o711);
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&plan_file).unwrap()).unwrap();
    let binds = plan["binds"].as_array().unwrap();
    assert!(
        binds.iter().all(|b| b["source"] != serde_json::json!(sb)),
        "{plan}"
    );
    assert!(
        binds.iter().any(|b| b["target"] == "/data"),
        "the volume is still bound: {plan}"
    );
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
}
