"""``fuse_addcmul``: a pattern pass that rewrites ``a + b * c * value`` into one
``addcmul(a, b, c, value=value)``, for any scalar ``value``."""

import pydantic
import torch

import passkit


def search(a, b, c, value):
    return a + b * c * value


def replace(a, b, c, value):
    return torch.addcmul(a, b, c, value=value)


class FuseAddcmul(passkit.PatternPass):
    """Fuse a scaled multiply-add into ``addcmul``."""

    name = "fuse_addcmul"

    class Options(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid", frozen=True)
        min_numel: int = pydantic.Field(0, ge=0, description="fuse only outputs this large or larger")

    def patterns(self):
        yield passkit.Pattern(
            search,
            replace,
            example_inputs=[torch.empty(8), torch.empty(8), torch.empty(8)],  # a, b, c: distinct tensors
            scalars={"value": 0.123},  # a wildcard: matches every value, not only 0.123
            extra_check=self.big_enough,
        )

    def big_enough(self, match):
        # imported here, not at the top: plugins are imported at every backend init
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        numel = match.output_node().meta["val"].numel()
        return statically_known_true(numel >= self.options.min_numel)
