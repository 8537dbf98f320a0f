"""The step the policy worker and PPO's critic share: `loop.StepLoop` over an `update.Update`
(DeepSpeed's own, or `layout_free.update.LayoutFreeUpdate`), `guard.StepGuard`, `recovery`."""
