-- vkd fencing for Slurm: refuses a job whose comment carries an epoch older
-- than the one vkd-slurm recorded for its node, so a deposed vkd (or a
-- stale plugin) cannot submit, whichever way its sbatch reaches slurmctld.
-- Installed as job_submit.lua beside slurm.conf with JobSubmitPlugins=lua;
-- printed by `vkd-slurm job-submit-lua --state-dir <dir>`.
local EPOCHS = "@EPOCHS@"

function slurm_job_submit(job_desc, part_list, submit_uid)
  local c = job_desc.comment
  if c == nil then return slurm.SUCCESS end
  local node, epoch = string.match(c, "^vkd:node=([%w%.%-]+);epoch=(%d+);")
  if node == nil then return slurm.SUCCESS end
  local f = io.open(EPOCHS .. node, "r")
  if f == nil then return slurm.SUCCESS end
  local text = f:read("*l")
  f:close()
  local current = tonumber(text)
  if current == nil then
    -- An unreadable epoch refuses every epoch until repaired, as vkd-slurm does.
    slurm.log_user("vkd fence: node %s has no readable epoch in %s", node, EPOCHS .. node)
    return slurm.ESLURM_ACCESS_DENIED
  end
  if tonumber(epoch) < current then
    slurm.log_user("vkd fence: node %s is at epoch %d, this job carries epoch %s", node, current, epoch)
    return slurm.ESLURM_ACCESS_DENIED
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

return slurm.SUCCESS
