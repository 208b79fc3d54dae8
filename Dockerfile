# vkd: the daemon binary only, on a distroless base, as a non-root user.
#
#   docker build -t vkd:0.1.0 .
#
# The build step is the one CI compiles (`cargo build --locked`, release
# profile here). The process provider runs Pods as programs of the image it
# runs in: distroless has none, so for it build FROM a base with the programs
# your image map names (see docs/process-provider.md).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin vkd

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/vkd /usr/local/bin/vkd
USER 65532:65532
EXPOSE 10250 10256
ENTRYPOINT ["/usr/local/bin/vkd"]
CMD ["run", "--help"]
