//! `vkd-slurm`: the Slurm provider as a plugin (`serve`), and what runs
//! inside its jobs (`run-job`, `run-container`, `enter`, `connect`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use vkd_slurm::{Config, SlurmProvider, job, slurm::Slurm};

/// sysexits' EX_USAGE: a bad flag or config.
const EX_USAGE: u8 = 64;

#[derive(Debug, Parser)]
#[command(name = "vkd-slurm", version, about = "vkd provider plugin for Slurm")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serves the provider protocol (vkd run --provider grpc --provider-endpoint ...).
    Serve(ServeArgs),
    /// Prints the job submit plugin that makes slurmctld refuse stale epochs.
    JobSubmitLua {
        #[arg(long, env = "VKD_STATE_DIR")]
        state_dir: PathBuf,
    },
    /// Inside a job: the batch script.
    RunJob { dir: PathBuf },
    /// Inside a job: one container, as a job step.
    RunContainer { dir: PathBuf, container: String },
    /// Inside a job: a command with a container's environment (kubectl exec).
    Enter {
        dir: PathBuf,
        container: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Inside a job: one port-forward connection to a port on this node.
    Connect { port: u16 },
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Where to listen: `unix:///path.sock` (made 0600, in a directory only
    /// this account or root can write) or `tls://host:port?cert=..&key=..&ca=..`
    /// (mutual TLS); plain TCP is refused.
    #[arg(long, env = "VKD_PROVIDER_ENDPOINT")]
    listen: String,
    /// The Pods' directories and the epochs, on a filesystem every compute node shares.
    #[arg(long, env = "VKD_STATE_DIR")]
    state_dir: PathBuf,
    /// The cluster's slurm.conf (SLURM_CONF for every Slurm command).
    #[arg(long, env = "SLURM_CONF")]
    slurm_conf: Option<PathBuf>,
    /// Submit to this partition, and count only its nodes.
    #[arg(long, env = "VKD_SLURM_PARTITION")]
    partition: Option<String>,
    /// How long one Slurm command may take.
    #[arg(long, default_value = "30s")]
    command_timeout: String,
    /// How often Slurm is asked what changed.
    #[arg(long, default_value = "1s")]
    poll: String,
    /// Memory for a Pod that asks none, in MiB.
    #[arg(long, default_value_t = 256)]
    default_memory_mib: u64,
    /// This binary as the compute nodes reach it (default: this one's path).
    #[arg(long, env = "VKD_SLURM_RUNNER")]
    runner: Option<PathBuf>,
    /// Serve as root, so that every Pod's job runs as root on its node: only
    /// for a throwaway cluster (a test's). Without it, root is refused.
    #[arg(long, env = "VKD_SLURM_JOBS_AS_ROOT")]
    jobs_as_root: bool,
}

fn duration(flag: &str, text: &str) -> Result<Duration, String> {
    vkd_provider::parse_duration(text)
        .filter(|d| !d.is_zero() && *d <= Duration::from_secs(3600))
        .ok_or_else(|| format!("--{flag}: {text:?} is not a duration of at most 1h"))
}

fn config(args: &ServeArgs) -> Result<(Config, vkd_grpc::Endpoint), String> {
    let endpoint = args
        .listen
        .parse()
        .map_err(|e: vkd_grpc::GrpcError| format!("--listen: {e}"))?;
    let runner = match &args.runner {
        Some(r) => r.clone(),
        None => std::env::current_exe().map_err(|e| format!("this binary's path: {e}"))?,
    };
    // The jobs run as this process's user: as root, every Pod's code would
    // be root on its node.
    if rustix::process::geteuid().is_root() && !args.jobs_as_root {
        return Err(
            "refusing to serve as root: every Pod's job would run as root on its \
                    node. Run vkd-slurm as a dedicated unprivileged account \
                    (docs/slurm-provider.md), or pass --jobs-as-root on a throwaway cluster"
                .into(),
        );
    }
    if !args.state_dir.is_absolute() {
        return Err("--state-dir: must be an absolute path (the compute nodes read it)".into());
    }
    Ok((
        Config {
            state_dir: args.state_dir.clone(),
            slurm: Slurm {
                conf: args.slurm_conf.clone(),
                partition: args.partition.clone(),
                timeout: duration("command-timeout", &args.command_timeout)?,
            },
            runner,
            poll: duration("poll", &args.poll)?,
            default_memory_mib: args.default_memory_mib.max(1),
        },
        endpoint,
    ))
}

async fn serve(config: Config, endpoint: vkd_grpc::Endpoint) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let provider = SlurmProvider::new(config, shutdown.clone())?;
    let stop = shutdown.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        stop.cancel();
    });
    let served =
        vkd_grpc::server::serve(std::sync::Arc::new(provider), &endpoint, shutdown).await?;
    tracing::info!(%endpoint, "serving the provider protocol for Slurm");
    served.await??;
    Ok(())
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vkd-slurm: a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = |r: Result<i32, job::JobError>| match r {
        Ok(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        Err(e) => {
            eprintln!("vkd-slurm: {e}");
            ExitCode::from(126)
        }
    };
    match cli.command {
        Command::Serve(args) => {
            let (config, endpoint) = match config(&args) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("vkd-slurm: invalid configuration: {e}");
                    return ExitCode::from(EX_USAGE);
                }
            };
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info".into()),
                )
                .init();
            match rt.block_on(serve(config, endpoint)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("vkd-slurm: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::JobSubmitLua { state_dir } => {
            print!("{}", SlurmProvider::job_submit_lua(&state_dir));
            ExitCode::SUCCESS
        }
        Command::RunJob { dir } => code(rt.block_on(job::run_job(&dir))),
        Command::RunContainer { dir, container } => {
            code(rt.block_on(job::run_container(&dir, &container)))
        }
        Command::Enter {
            dir,
            container,
            command,
        } => {
            drop(rt);
            let e = job::enter(&dir, &container, &command);
            eprintln!("vkd-slurm: {e}");
            ExitCode::from(
                if matches!(&e, job::JobError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
                {
                    127
                } else {
                    126
                },
            )
        }
        Command::Connect { port } => code(rt.block_on(job::connect(port)).map(|()| 0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_tcp_is_refused_to_listen_on() {
        for plain in ["tcp://127.0.0.1:7070", "http://127.0.0.1:7070"] {
            let args = ServeArgs {
                listen: plain.into(),
                state_dir: "/shared/vkd-slurm".into(),
                slurm_conf: None,
                partition: None,
                command_timeout: "30s".into(),
                poll: "1s".into(),
                default_memory_mib: 256,
                runner: None,
                jobs_as_root: true,
            };
            let e = config(&args).err().unwrap_or_default();
            assert!(e.starts_with("--listen: "), "{e}");
            assert!(e.contains("plain TCP is refused"), "{e}");
        }
    }
}
