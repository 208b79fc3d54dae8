//! Containers in namespaces of their own (where the tests run as root): the
//! Pod's volumes at the paths the spec names, its own /proc, /tmp and
//! /dev/termination-log, a read-only host, exec in the same namespaces, and
//! nothing of the Pod left on the host once it is gone.
#![allow(clippy::unwrap_used)] // a test file: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::{fence, isolated, log_text, provider, remove, running, spec, stream_io, wait_for};
use tokio::io::AsyncReadExt;
use vkd_provider::{
    ContainerState, InstancePhase, Mount, Provider, RestartPolicy, Volume, VolumeFile, VolumeSource,
};

fn processes(pattern: &str) -> usize {
    std::process::Command::new("pgrep")
        .args(["-f", pattern])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
        .unwrap_or(0)
}

fn mount(volume: &str, path: &str, sub_path: Option<&str>, read_only: bool) -> Mount {
    Mount {
        volume: volume.into(),
        path: path.into(),
        sub_path: sub_path.map(str::to_owned),
        read_only,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_container_sees_its_volumes_at_their_paths_and_only_its_own_processes() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-isolated";
    let script = "\
        cat /etc/vkd-isolation-test/key; echo; \
        cat /single; echo; \
        echo pid=$$; \
        echo procs=$(ls /proc | grep -c '^[0-9]'); \
        echo host=$(cat /etc/hostname); \
        touch /usr/vkd-isolation-test 2>/dev/null || echo root-read-only; \
        touch /config-ro/new 2>/dev/null || echo volume-read-only; \
        echo scratch > /tmp/x && echo tmp=$(cat /tmp/x); \
        echo kept > /data/deep/f && echo data=$(cat /data/deep/f); \
        exec sleep 3601";
    let mut s = spec(uid, &["sh", "-c", script]);
    s.volumes = vec![
        Volume {
            name: "config".into(),
            source: VolumeSource::Files {
                files: vec![VolumeFile {
                    path: "key".into(),
                    data: b"from-the-volume".to_vec(),
                    mode: 0o644,
                }],
            },
        },
        Volume {
            name: "scratch".into(),
            source: VolumeSource::EmptyDir {
                size_limit: None,
                memory: false,
            },
        },
    ];
    s.containers[0].mounts = vec![
        mount("config", "/etc/vkd-isolation-test", None, false),
        mount("config", "/single", Some("key"), false),
        mount("config", "/config-ro", None, true),
        mount("scratch", "/data/deep", None, false),
    ];
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = wait_for("the script's output", async || {
        let t = log_text(&p, uid, "main").await;
        t.contains("data=").then_some(t)
    })
    .await;
    for want in [
        "from-the-volume\nfrom-the-volume\n",
        "pid=1\n",
        "host=pod-u-isolated\n",
        "root-read-only\n",
        "volume-read-only\n",
        "tmp=scratch\n",
        "data=kept\n",
    ] {
        assert!(log.contains(want), "no {want:?} in {log:?}");
    }
    // Only its own processes: sh (PID 1), the subshell, ls and grep; the
    // host has many more.
    let procs: usize = log
        .split("procs=")
        .nth(1)
        .and_then(|t| t.lines().next()?.parse().ok())
        .unwrap_or(usize::MAX);
    assert!(procs <= 4, "{procs} processes in /proc: {log}");
    // Nothing of it reached the host.
    for p in [
        "/etc/vkd-isolation-test",
        "/single",
        "/config-ro",
        "/data/deep",
    ] {
        assert!(
            !std::path::Path::new(p).exists(),
            "{p} was made on the host"
        );
    }

    // exec enters the same namespaces.
    let (w, mut r) = tokio::io::duplex(4096);
    let code = p
        .exec(
            uid,
            "main",
            vec![
                "sh".into(),
                "-c".into(),
                "cat /etc/vkd-isolation-test/key; echo; cat /proc/1/cmdline | tr '\\0' ' '; exit 3"
                    .into(),
            ],
            stream_io(w, false),
        )
        .await
        .unwrap();
    let mut out = String::new();
    r.read_to_string(&mut out).await.unwrap();
    assert_eq!(code, 3, "{out}");
    assert!(out.starts_with("from-the-volume\nsleep 3601"), "{out:?}");

    remove(&p, uid).await;
    assert_eq!(processes("sleep 3601"), 0, "a process outlived its Pod");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_termination_message_is_read_from_the_path_the_spec_names() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-isolated-msg";
    let mut s = spec(
        uid,
        &[
            "sh",
            "-c",
            "echo 'gone for good' > /dev/termination-log; exit 4",
        ],
    );
    s.restart_policy = RestartPolicy::Never;
    p.create(&fence(), &s).await.unwrap();
    let i = wait_for("the Pod to end", async || {
        let i = p.get(uid).await.unwrap()?;
        (i.phase == InstancePhase::Failed).then_some(i)
    })
    .await;
    let ContainerState::Terminated(t) = &i.containers[0].state else {
        panic!("{:?}", i.containers[0].state)
    };
    assert_eq!(t.exit_code, 4);
    assert_eq!(t.message.as_deref().map(str::trim), Some("gone for good"));
    assert!(
        std::fs::read_to_string("/dev/termination-log").is_err(),
        "the message went to the host's /dev"
    );
    remove(&p, uid).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A link a Pod plants in its volume never leads a subPath mount out of it:
/// the container that would mount it does not start, and says why.
#[tokio::test(flavor = "multi_thread")]
async fn a_sub_path_through_a_planted_link_does_not_leave_its_volume() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-isolated-escape";
    let mut s = spec(uid, &["sh", "-c", "ls /escaped; sleep 3602"]);
    s.restart_policy = RestartPolicy::Never;
    s.volumes = vec![Volume {
        name: "scratch".into(),
        source: VolumeSource::EmptyDir {
            size_limit: None,
            memory: false,
        },
    }];
    s.init_containers = vec![vkd_provider::ContainerSpec {
        name: "plant".into(),
        image: "busybox".into(),
        command: vec![
            "sh".into(),
            "-c".into(),
            "rmdir /scratch/escape; ln -s / /scratch/escape".into(),
        ],
        mounts: vec![mount("scratch", "/scratch", None, false)],
        ..Default::default()
    }];
    s.containers[0].mounts = vec![mount("scratch", "/escaped", Some("escape"), false)];
    p.create(&fence(), &s).await.unwrap();
    let i = wait_for("the Pod to fail", async || {
        let i = p.get(uid).await.unwrap()?;
        (i.phase == InstancePhase::Failed).then_some(i)
    })
    .await;
    let ContainerState::Terminated(t) = &i.containers[0].state else {
        panic!("{:?}", i.containers[0].state)
    };
    assert_eq!(t.exit_code, 126, "{t:?}");
    let log = log_text(&p, uid, "main").await;
    assert!(log.contains("leads out of its volume"), "{log:?}");
    assert_eq!(processes("sleep 3602"), 0);
    remove(&p, uid).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// `medium: Memory` is a tmpfs of `sizeLimit`, shared by the Pod's
/// containers, open to every user (sticky, as the kubelet's tmpfs root), and
/// gone from the host with the Pod.
#[tokio::test(flavor = "multi_thread")]
async fn a_memory_backed_empty_dir_is_a_shared_tmpfs_that_goes_with_the_pod() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-isolated-tmpfs";
    let mut s = spec(
        uid,
        &[
            "sh",
            "-c",
            "echo type=$(stat -f -c %T /cache) size=$(df -k /cache | tail -1 | awk '{print $2}') \
             mode=$(stat -c %a /cache) seen=$(cat /cache/note); exec sleep 3604",
        ],
    );
    s.volumes = vec![Volume {
        name: "cache".into(),
        source: VolumeSource::EmptyDir {
            size_limit: Some(8 << 20),
            memory: true,
        },
    }];
    s.init_containers = vec![vkd_provider::ContainerSpec {
        name: "fill".into(),
        image: "busybox".into(),
        command: vec![
            "sh".into(),
            "-c".into(),
            "echo from-init > /cache/note".into(),
        ],
        mounts: vec![mount("cache", "/cache", None, false)],
        ..Default::default()
    }];
    s.containers[0].mounts = vec![mount("cache", "/cache", None, false)];
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = wait_for("the container's report", async || {
        let l = log_text(&p, uid, "main").await;
        l.contains("seen=").then_some(l)
    })
    .await;
    assert!(
        log.contains("type=tmpfs size=8192 mode=1777 seen=from-init"),
        "{log:?}"
    );
    let sandbox = dir.join("pods").join(uid);
    assert_eq!(vkd_process::isolation::mounts_under(&sandbox).len(), 1);
    remove(&p, uid).await;
    assert!(vkd_process::isolation::mounts_under(&sandbox).is_empty());
    assert_eq!(processes("sleep 3604"), 0);
    let _ = std::fs::remove_dir_all(dir);
}

/// `shareProcessNamespace: true`: the containers see each other's processes,
/// under the Pod's pause process, and all of them end with the Pod.
#[tokio::test(flavor = "multi_thread")]
async fn a_shared_process_namespace_shows_every_container_under_one_init() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-isolated-shared-pid";
    let mut s = spec(
        uid,
        &[
            "sh",
            "-c",
            // Waits (10 s at most) for the other container, which starts
            // after this one, then lists every process it can see. (The
            // quotes keep this script's own command line from matching.)
            "for i in $(seq 100); do cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' \
             | grep -q 'sleep 36''06' && break; sleep 0.1; done; \
             for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done; \
             echo init=$(tr '\\0' ' ' < /proc/1/cmdline); exec sleep 3605",
        ],
    );
    s.share_process_namespace = true;
    s.containers.push(vkd_provider::ContainerSpec {
        name: "other".into(),
        image: "busybox".into(),
        command: vec!["sleep".into(), "3606".into()],
        ..Default::default()
    });
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = wait_for("the container's report", async || {
        let l = log_text(&p, uid, "main").await;
        l.contains("init=").then_some(l)
    })
    .await;
    assert!(log.contains("sleep 3606"), "{log}");
    assert!(log.contains("init=") && log.contains("--pause"), "{log}");
    remove(&p, uid).await;
    assert_eq!(processes("sleep 3605") + processes("sleep 3606"), 0);
    assert_eq!(
        processes("process-launch --user 65534:65534 --env-file /dev/null"),
        0
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// An exec that comes as the container starts runs in the container's root,
/// or is refused; never in the host's namespaces, where the launcher waits
/// before its child has entered the container's.
#[tokio::test(flavor = "multi_thread")]
async fn an_exec_as_the_container_starts_sees_its_root_or_nothing() {
    let Some((p, dir)) = isolated() else { return };
    // The container's /proc, of its own PID namespace, has its program as
    // process 1; the host's has the host's init.
    let probe = "tr '\\0' ' ' < /proc/1/cmdline".to_owned();
    for n in 0..4 {
        let uid = format!("u-early-{n}");
        let s = spec(&uid, &["sleep", "3608"]);
        p.create(&fence(), &s).await.unwrap();
        let mut seen = None;
        for _ in 0..2000 {
            let (w, mut r) = tokio::io::duplex(4096);
            let argv = vec!["sh".into(), "-c".into(), probe.clone()];
            if let Ok(0) = p.exec(&uid, "main", argv, stream_io(w, false)).await {
                let mut out = String::new();
                r.read_to_string(&mut out).await.unwrap();
                seen = Some(out);
                break;
            }
        }
        let seen = seen.unwrap_or_else(|| panic!("Pod {n}: no exec succeeded"));
        assert!(seen.ends_with("sleep 3608 "), "Pod {n}: {seen:?}");
        remove(&p, &uid).await;
    }
    assert_eq!(processes("sleep 3608"), 0, "a process outlived its Pod");
    let _ = std::fs::remove_dir_all(dir);
}

/// `fsGroup`, as the kubelet applies it: an emptyDir is the group's and
/// setgid, so what the Pod makes in it is the group's; a subPath directory
/// made in it is root's with its mode; a Secret's files are the group's and
/// readable by it.
#[tokio::test(flavor = "multi_thread")]
async fn fs_group_owns_the_volumes_as_on_the_kubelet() {
    let Some((p, dir)) = isolated() else { return };
    let uid = "u-isolated-fsgroup";
    let mut s = spec(
        uid,
        &[
            "sh",
            "-c",
            "touch /cache/new; for f in /cache /cache/new /sub /secret/key; do \
             echo \"$f $(stat -c '%a %u %g' $f)\"; done; echo listed; exec sleep 3611",
        ],
    );
    s.fs_group = Some(123);
    s.volumes = vec![
        Volume {
            name: "cache".into(),
            source: VolumeSource::EmptyDir {
                size_limit: Some(8 << 20),
                memory: true,
            },
        },
        Volume {
            name: "secret".into(),
            source: VolumeSource::Files {
                files: vec![vkd_provider::VolumeFile {
                    path: "key".into(),
                    data: b"value".to_vec(),
                    mode: 0o400,
                }],
            },
        },
    ];
    s.containers[0].mounts = vec![
        mount("cache", "/cache", None, false),
        mount("cache", "/sub", Some("a/b"), false),
        mount("secret", "/secret", None, true),
    ];
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = wait_for("the container's listing", async || {
        let l = log_text(&p, uid, "main").await;
        l.contains("listed").then_some(l)
    })
    .await;
    let (user, _) = p.run_as().unwrap();
    let made = log.lines().find(|l| l.starts_with("/cache/new ")).unwrap();
    assert!(made.ends_with(&format!(" {user} 123")), "{log}");
    for line in [
        format!("/cache 3777 {user} 123"),
        "/sub 3777 0 123".to_owned(),
        format!("/secret/key 440 {user} 123"),
    ] {
        assert!(log.contains(&line), "{line:?} in {log}");
    }
    remove(&p, uid).await;
    assert_eq!(processes("sleep 3611"), 0);
    let _ = std::fs::remove_dir_all(dir);
}

/// An image's own files (`images[].files`): with namespaces each is shown at
/// its path, read-only, and a program among them runs from there.
#[tokio::test(flavor = "multi_thread")]
async fn an_images_own_files_are_at_their_paths_and_its_program_runs() {
    let (probe, probe_dir) = provider();
    let namespaces = probe.isolation_mode() == "namespaces";
    drop(probe);
    let _ = std::fs::remove_dir_all(probe_dir);
    if !namespaces {
        eprintln!("no namespaces here (not root?): nothing to check");
        return;
    }
    let files = std::env::temp_dir().join(format!("vkd-image-files-{}", std::process::id()));
    std::fs::create_dir_all(&files).unwrap();
    std::fs::write(files.join("greeting"), "hello from the image\n").unwrap();
    let tool = files.join("tool");
    std::fs::write(
        &tool,
        "#!/bin/sh\necho tool-ran \"$@\"; cat /image/greeting; exec sleep 3612\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    for p in [&files, &tool] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(
        files.join("greeting"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let mut config = common::config();
    config.images[0].files = [
        ("/image/greeting".into(), files.join("greeting")),
        ("/image-tool".into(), tool.clone()),
    ]
    .into_iter()
    .collect();
    let dir = std::env::temp_dir().join(format!("vkd-process-{}", uuid::Uuid::new_v4().simple()));
    let p = vkd_process::ProcessProvider::open(config, &dir, common::shim_exe()).unwrap();
    let uid = "u-isolated-image-files";
    let s = spec(uid, &["/image-tool", "with-arg"]);
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = wait_for("the image's program", async || {
        let l = log_text(&p, uid, "main").await;
        l.contains("hello from the image").then_some(l)
    })
    .await;
    assert!(log.contains("tool-ran with-arg"), "{log}");
    // Read-only, as an image's layers are to a container.
    let (w, mut r) = tokio::io::duplex(4096);
    let argv = vec![
        "sh".into(),
        "-c".into(),
        "echo x > /image/greeting && echo wrote || echo refused".into(),
    ];
    p.exec(uid, "main", argv, stream_io(w, false))
        .await
        .unwrap();
    let mut out = String::new();
    r.read_to_string(&mut out).await.unwrap();
    assert!(out.contains("refused"), "{out}");
    remove(&p, uid).await;
    assert_eq!(processes("sleep 3612"), 0);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(files);
}

/// An image's file can stand where the host has a program of its own, even
/// behind the host's links (`/bin` is `usr/bin` on merged-/usr hosts): the
/// conformance harness gives busybox's image its `/bin/sh` so, and a spec
/// that runs `/bin/sh` by path gets the image's shell, not the host's.
#[tokio::test(flavor = "multi_thread")]
async fn an_images_file_stands_in_for_a_host_program_of_the_same_path() {
    let (probe, probe_dir) = provider();
    let namespaces = probe.isolation_mode() == "namespaces";
    drop(probe);
    let _ = std::fs::remove_dir_all(probe_dir);
    if !namespaces || !std::path::Path::new("/bin/bash").exists() {
        eprintln!("no namespaces (not root?) or no bash here: nothing to check");
        return;
    }
    let mut config = common::config();
    config.images[0].files = [("/bin/sh".into(), "/bin/bash".into())]
        .into_iter()
        .collect();
    let dir = std::env::temp_dir().join(format!("vkd-process-{}", uuid::Uuid::new_v4().simple()));
    let p = vkd_process::ProcessProvider::open(config, &dir, common::shim_exe()).unwrap();
    let uid = "u-isolated-image-shell";
    let s = spec(
        uid,
        &[
            "/bin/sh",
            "-c",
            "[[ -n $BASH_VERSION ]] && echo image-shell-is-bash; exec sleep 3613",
        ],
    );
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    let log = wait_for("the image's shell", async || {
        let l = log_text(&p, uid, "main").await;
        l.contains("image-shell-is-bash").then_some(l)
    })
    .await;
    assert!(log.contains("image-shell-is-bash"), "{log}");
    remove(&p, uid).await;
    assert_eq!(processes("sleep 3613"), 0);
    let _ = std::fs::remove_dir_all(dir);
}
